"""A local Hugging Face GPT-2 checkpoint -> its config and a lazy, one-tensor-at-a-time reader.

Handles every layout found in the wild: a single model.safetensors, sharded safetensors with an index,
pytorch_model.bin (optionally sharded), as a repo directory or a bare weights file. Sources are only ever
opened for reading.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2port.config import PRESETS, GPTConfig, read_json
from gpt2port.errors import GPT2PortError
from gpt2port.keymap import HF_EMBEDDING, strip_prefix
from gpt2port.safetensors_format import LFS_POINTER_PREFIX, TensorEntry, read_header, read_tensor

# In order of preference: safetensors cannot run code and can be streamed; .bin is the fallback.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "encoder.json", "vocab.bpe")


@dataclass(frozen=True)
class SourceTensor:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    entry: TensorEntry | None  # safetensors: where its bytes are; None for pickled (.bin) tensors


class Source:
    """An opened HF checkpoint. `tensors` lists every key in file order; `read(key)` loads just that tensor."""

    def __init__(self, path: Path, weight_files: list[Path], tensors: dict[str, SourceTensor],
                 hf_config: dict | None, config_path: Path | None, pickled: dict[str, torch.Tensor] | None = None,
                 index_file: Path | None = None):
        self.path = path
        self.index_file = index_file
        self.weight_files = weight_files
        self.tensors = tensors
        self.hf_config = hf_config
        self.config_path = config_path
        self._pickled = pickled
        self._handles: dict[Path, object] = {}
        self.config = self._config()

    @property
    def root(self) -> Path:
        return self.path if self.path.is_dir() else self.path.parent

    def tokenizer_files(self) -> list[Path]:
        return [self.root / n for n in TOKENIZER_FILES if (self.root / n).is_file()]

    def side_files(self) -> list[Path]:
        """The small files that travel with the weights: index, config, tokenizer."""
        return ([self.index_file] if self.index_file else []) + ([self.config_path] if self.config_path else []) + self.tokenizer_files()

    def read(self, key: str, into: torch.Tensor | None = None) -> torch.Tensor:
        """One tensor. With `into` (a uint8 buffer), safetensors data lands there and the result is a view of it."""
        t = self.tensors[key]
        if self._pickled is not None:
            return self._pickled[key]
        if t.file not in self._handles:
            self._handles[t.file] = open(t.file, "rb")
        return read_tensor(self._handles[t.file], t.entry, into)

    def dtype(self) -> torch.dtype:
        """The checkpoint's dtype: that of its token embedding (mask buffers are often fp32 in fp16 files)."""
        for key, t in self.tensors.items():
            if strip_prefix(key) == HF_EMBEDDING:
                return t.dtype
        return next(iter(self.tensors.values())).dtype

    def close(self) -> None:
        for h in self._handles.values():
            h.close()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _config(self) -> GPTConfig:
        shapes = {strip_prefix(k): t.shape for k, t in self.tensors.items()}
        if self.hf_config is None:
            return infer_config(shapes, self.path)
        _check_config_values(self.hf_config, self.config_path)
        config = GPTConfig.from_hf_config(self.hf_config, str(self.config_path))
        # Before anything sizes itself by the config: a config.json copied from another size (or a hostile one
        # saying 10**12 layers) must fail here in words, not later as 300 "missing keys" or an out-of-memory.
        check_config_matches_weights(config, shapes, self.config_path)
        return config


def open_source(path: str | Path) -> Source:
    path = Path(path)
    if not path.exists():
        raise GPT2PortError(f"{path}: no such file or directory")
    if path.is_dir():
        weights = next((path / n for n in WEIGHT_FILES if os.path.lexists(path / n)), None)
        if weights is None:
            raise GPT2PortError(f"{path}: no GPT-2 weights found (looked for {', '.join(WEIGHT_FILES)})")
        _check_regular_file(weights)
    else:
        weights = path
    config_path = weights.parent / "config.json"
    hf_config = read_json(config_path) if config_path.is_file() else None
    if weights.stat().st_size == 0:
        raise GPT2PortError(f"{weights}: file is empty")
    name = weights.name
    if name.endswith(".index.json"):
        files, tensors, pickled = _open_sharded(weights)
    elif name.endswith(".safetensors"):
        files, tensors, pickled = [weights], _safetensors_tensors(weights), None
    elif name.endswith((".bin", ".pt", ".pth")):
        pickled = _load_pickle(weights)
        files, tensors = [weights], {k: SourceTensor(k, v.dtype, tuple(v.shape), weights, None) for k, v in pickled.items()}
    else:
        raise GPT2PortError(f"{weights}: unrecognised weights file (expected .safetensors, .bin or an .index.json)")
    if not tensors:
        raise GPT2PortError(f"{weights}: holds no tensors")
    return Source(path, files, tensors, hf_config, config_path if hf_config is not None else None, pickled,
                  weights if name.endswith(".index.json") else None)


def _check_regular_file(file: Path) -> None:
    # An HF cache snapshot is symlinks into blobs/: a deleted blob leaves a dangling link, worth naming as such.
    if file.is_symlink() and not file.exists():
        raise GPT2PortError(f"{file}: is a broken symbolic link (its target {os.readlink(file)} is missing)")
    if not file.is_file():
        raise GPT2PortError(f"{file}: is a directory or special file, expected a weights file")


def _safetensors_tensors(file: Path) -> dict[str, SourceTensor]:
    header = read_header(file)
    return {k: SourceTensor(k, e.dtype, e.shape, file, e) for k, e in header.entries.items()}


def _open_sharded(index_path: Path):
    index = read_json(index_path)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise GPT2PortError(f"{index_path}: no weight_map")
    for key, shard in weight_map.items():
        # Shards live beside the index: a name with a path in it could make us read (and hash into the manifest)
        # any file on the disk.
        if not isinstance(shard, str) or shard in ("", ".", "..") or "/" in shard or "\\" in shard:
            raise GPT2PortError(f"{index_path}: key {key!r} is placed in {shard!r}, which is not a file name "
                                f"beside the index")
    shard_names = sorted(set(weight_map.values()))
    files = [index_path.parent / s for s in shard_names]
    for f in files:
        if not f.is_file():
            raise GPT2PortError(f"{f}: shard listed in {index_path.name} is missing")
    tensors: dict[str, SourceTensor] = {}
    pickled: dict[str, torch.Tensor] | None = None
    for f in files:
        if f.name.endswith(".safetensors"):
            found = _safetensors_tensors(f)
        else:
            loaded = _load_pickle(f)
            pickled = {**(pickled or {}), **loaded}
            found = {k: SourceTensor(k, v.dtype, tuple(v.shape), f, None) for k, v in loaded.items()}
        for k, t in found.items():
            if weight_map.get(k) != f.name:
                raise GPT2PortError(f"{f}: holds {k!r}, which {index_path.name} places in {weight_map.get(k)!r}")
            tensors[k] = t
    absent = [k for k in weight_map if k not in tensors]
    if absent:
        raise GPT2PortError(f"{index_path}: keys listed but absent from their shards: {', '.join(absent[:8])}")
    return files, tensors, pickled


def _load_pickle(file: Path) -> dict[str, torch.Tensor]:
    """torch.load with weights_only=True: tensors and plain containers only, so a hostile pickle cannot run code."""
    with open(file, "rb") as f:
        if f.read(len(LFS_POINTER_PREFIX)) == LFS_POINTER_PREFIX:
            raise GPT2PortError(f"{file}: is a Git LFS pointer file, not the weights (fetch the real file)")
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols on stderr; the error says it all
            warnings.simplefilter("ignore")
            try:
                sd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):  # legacy (pre-zip) format cannot be mapped; load it normally
                    raise
                sd = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's own message invites the user to retry with weights_only=False: exactly what must not be done
        # with a file that asks for arbitrary globals. Keep only the refused instruction.
        found = re.search(r"WeightsUnpickler error:\s*(.+?)(?: was not an allowed global|\n|$)", str(e))
        detail = found.group(1).strip() if found else "not plain tensors"
        raise GPT2PortError(f"{file}: refused: not plain tensors ({detail}); gpt2port loads .bin files with "
                            f"torch.load(weights_only=True), which never runs code from a pickle") from None
    except Exception as e:  # noqa: BLE001 - torch raises many types for bad pickles; all mean "unreadable"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GPT2PortError(f"{file}: cannot be loaded as weights ({first})") from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise GPT2PortError(f"{file}: is not a flat state dict of tensors")
    return sd


_LAYER = re.compile(r"^h\.(\d+)\.")
_CONFIG_SIZES = ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions", "n_ctx", "n_inner")
_CONFIG_NULLABLE = ("n_positions", "n_ctx", "n_inner")  # null means "the default"


def _check_config_values(hf: dict, path: Path) -> None:
    """Sizes in config.json must be positive integers (a hand-edited file may say "twelve", 0 or -1)."""
    for key in _CONFIG_SIZES:
        if key not in hf or (hf[key] is None and key in _CONFIG_NULLABLE):
            continue  # absent: from_hf_config names a missing required field, or a default applies
        value = hf[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise GPT2PortError(f"{path}: {key} must be a positive integer, got {value!r}")


def layers_held(shapes: dict[str, tuple[int, ...]], where) -> int | None:
    """How many transformer blocks the tensors hold (h.0 ... h.N-1), or None if they hold no blocks at all."""
    seen = {int(m.group(1)) for k in shapes if (m := _LAYER.match(k))}
    if not seen:
        return None
    n = max(seen) + 1
    if len(seen) != n:
        gap = min(set(range(n)) - seen)
        raise GPT2PortError(f"{where}: the weights hold layers up to h.{n - 1} but nothing for h.{gap}")
    return n


def check_config_matches_weights(config: GPTConfig, shapes: dict[str, tuple[int, ...]], config_path: Path) -> None:
    """config.json and the tensors must describe the same model; name every number that disagrees."""
    held = {"n_layer": layers_held(shapes, config_path.parent)}
    wte, wpe, fc = shapes.get("wte.weight"), shapes.get("wpe.weight"), shapes.get("h.0.mlp.c_fc.weight")
    if wte is not None and len(wte) == 2:
        held["vocab_size"], held["n_embd"] = wte
    if wpe is not None and len(wpe) == 2:
        held["n_positions"] = wpe[0]
    if fc is not None and len(fc) == 2:
        held["mlp_width"] = fc[1]
    said = {"n_layer": config.n_layer, "n_embd": config.n_embd, "vocab_size": config.vocab_size,
            "n_positions": config.n_positions, "mlp_width": config.mlp_width}
    differ = [k for k, v in held.items() if v is not None and v != said[k]]
    if not differ:
        return
    words = {"n_layer": "{} layers", "n_embd": "width {}", "vocab_size": "vocab_size {}",
             "n_positions": "n_positions {}", "mlp_width": "MLP width {}"}

    def describe(facts: dict) -> str:
        text = ", ".join(words[k].format(facts[k]) for k in differ)
        size = _preset_name(facts.get("n_layer"), facts.get("n_embd"))
        return text + (f" ({size})" if size else "")

    raise GPT2PortError(f"{config_path} says {describe(said)}; the weights hold {describe(held)}")


def _preset_name(n_layer, n_embd) -> str | None:
    return next((name for name, p in PRESETS.items() if p["n_layer"] == n_layer and p["n_embd"] == n_embd), None)


def infer_config(shapes: dict[str, tuple[int, ...]], where: Path) -> GPTConfig:
    """A config from tensor shapes alone, for a bare weights file. n_head is not visible in any shape, so only the
    four official sizes can be recognised; anything else needs its config.json."""
    try:
        vocab, n_embd = shapes["wte.weight"]
        n_positions = shapes["wpe.weight"][0]
        n_inner = shapes["h.0.mlp.c_fc.weight"][1]
    except (KeyError, ValueError):
        raise GPT2PortError(f"{where}: no config.json beside the weights, and they do not look like GPT-2 "
                            f"(no wte/wpe/h.0 tensors)") from None
    n_layer = 1 + max(int(m.group(1)) for k in shapes if (m := _LAYER.match(k)))
    for preset in PRESETS.values():
        if preset["n_layer"] == n_layer and preset["n_embd"] == n_embd:
            return GPTConfig(**preset, vocab_size=vocab, n_positions=n_positions,
                             n_inner=None if n_inner == 4 * n_embd else n_inner)
    raise GPT2PortError(f"{where}: no config.json beside the weights, and {n_layer} layers x {n_embd} wide is not an "
                        f"official GPT-2 size, so n_head cannot be known; put its config.json beside it")
