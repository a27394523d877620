"""A gpt2port checkpoint directory: where it is, what it holds, reading its tensors mapped, writing one whole.

Layout: model.safetensors (canonical names, the tied head stored once (an untied one as lm_head.weight), metadata
tagging the format version: see layouts/gpt2port.py),
config.json (GPTConfig fields plus a format tag), the tokenizer files, manifest.json (provenance).
This module knows nothing of the model class: it hands out a config and tensors, and takes any module whose
state_dict holds the canonical names.
"""

from __future__ import annotations

import datetime
import math
import os
from pathlib import Path
from typing import Callable

import torch

from gpt2port.config import ALIASES, ConfigError, GPTConfig, canonical_name, is_known_name
from gpt2port.dtypes import DTYPE_LABELS, parse_dtype
from gpt2port.errors import GPT2PortError, did_you_mean
from gpt2port.inputs import read_json
from gpt2port.filekind import real
from gpt2port.formats import FLOAT_DTYPES
from gpt2port.formats.safetensors import Header, mmap_tensors, read_header, stream_safetensors
from gpt2port.fsio import copy_file, refuse_overlap, staged_directory, write_json, write_mark
from gpt2port.hashing import BackgroundHasher, Hashes
from gpt2port.layouts import canonical
from gpt2port.layouts.gpt2port import FORMAT_KEY, READABLE, metadata_for
from gpt2port.tokenizer import TOKENIZER_FILES, from_directory
from gpt2port.version import __version__

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
MANIFEST = "manifest.json"
CONFIG_FORMAT = "gpt2port"
DEFAULT_ROOT = Path("checkpoints")


# --- where a checkpoint is -------------------------------------------------------------------------------------

def root() -> Path:
    """Where NAMEs live: ./checkpoints, or $GPT2PORT_CHECKPOINTS."""
    return Path(os.environ.get("GPT2PORT_CHECKPOINTS", DEFAULT_ROOT))


def default_dir(name: str) -> Path:
    return root() / canonical_name(name)


def resolve(ckpt: str | Path) -> Path:
    """A checkpoint directory from a path, from a model NAME (-> ./checkpoints/NAME), or from the name of any
    directory under the checkpoints folder (what `download ORG/REPO` and `--out checkpoints/X` write)."""
    path = Path(ckpt)
    if path.is_dir():
        if not is_checkpoint(path):
            raise GPT2PortError(f"{path}: not a gpt2port checkpoint (needs {WEIGHTS} and {CONFIG}; "
                                f"for a Hugging Face directory run `gpt2port convert {path} --out DIR` first)")
        return path
    if is_known_name(str(ckpt)):
        found = default_dir(str(ckpt))
        if found.is_dir():
            return resolve(found)
        raise GPT2PortError(f"{found}: no converted checkpoint for {ckpt!r} (run `gpt2port download {ckpt}`; "
                            f"{_listing()})")
    if path.exists():
        raise GPT2PortError(f"{path}: is a file; a checkpoint is a directory")
    bare = len(path.parts) == 1 or (len(path.parts) == 2 and not Path(path.parts[0]).exists())
    if not path.is_absolute() and bare and path.name not in (".", ".."):
        # `download org/repo` writes root()/repo: the repo id and its last part both find it again. A path under
        # a directory that exists here (runs/x) is a path, and a miss there is not looked for elsewhere.
        under_root = root() / path.name
        if under_root.is_dir():
            return resolve(under_root)
    raise GPT2PortError(f"{path}: no such checkpoint directory{_near(str(ckpt))} ({_listing()})")


def _near(name: str) -> str:
    """A suggestion for a mistyped NAME: a known model name, or a checkpoint under the checkpoints folder."""
    try:
        here = [p.name for p in root().iterdir() if is_checkpoint(p)]
    except OSError:
        here = []
    return did_you_mean(name, [*ALIASES, *here])


def _listing() -> str:
    """What the checkpoints folder holds, for a message about a name that is not there."""
    folder = root()
    try:
        names = sorted(p.name for p in folder.iterdir() if is_checkpoint(p))
    except OSError:
        return f"{folder} does not exist yet"
    if not names:
        return f"{folder} holds no checkpoint"
    shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
    return f"{folder} holds: {shown}"


def load_tokenizer(ckpt: str | Path):
    """The GPT-2 BPE of a checkpoint (directory or NAME), or of any directory holding GPT-2 tokenizer files, as a
    tiktoken.Encoding built from those files (no network)."""
    path = Path(ckpt)
    return from_directory(path if path.is_dir() else resolve(ckpt))


def is_checkpoint(path: Path) -> bool:
    return (path / WEIGHTS).is_file() and (path / CONFIG).is_file()


# --- what it holds ---------------------------------------------------------------------------------------------

def read_config(ckpt_dir: Path) -> GPTConfig:
    data = read_json(ckpt_dir / CONFIG)
    if data.get("format") != CONFIG_FORMAT:
        raise GPT2PortError(f"{ckpt_dir / CONFIG}: not a gpt2port config (no \"format\": \"{CONFIG_FORMAT}\"); for a "
                            f"Hugging Face directory run `gpt2port convert {ckpt_dir} --out DIR` first")
    if not isinstance(data.get("model"), dict):
        raise GPT2PortError(f"{ckpt_dir / CONFIG}: has no valid \"model\" section")
    try:
        config = GPTConfig.from_dict(data["model"])
    except ConfigError as e:
        raise e.named(ckpt_dir / CONFIG, f"model.{e.field}") from None
    # Before anything sizes itself by it: the parameters it claims must fit in the weights file (at 2 bytes each, the
    # smallest float dtype), so that a config.json claiming 10**9 layers is refused here, not after gigabytes.
    weights = ckpt_dir / WEIGHTS
    _, n_params = canonical.counts(config)
    if weights.is_file() and 2 * n_params > weights.stat().st_size:
        raise GPT2PortError(f"{ckpt_dir / CONFIG}: describes a model of {n_params:,} parameters, more than "
                            f"{weights.name} ({weights.stat().st_size:,} bytes) can hold")
    return config


def config_json(config: GPTConfig) -> dict:
    model = config.to_dict()
    if model.pop("tie_word_embeddings"):  # said only when false (v2): a tied model's config.json is as v1 wrote it
        return {"format": CONFIG_FORMAT, "format_version": 1, "model": model}
    return {"format": CONFIG_FORMAT, "format_version": 2, "model": {**model, "tie_word_embeddings": False}}


def read_manifest(ckpt_dir: Path) -> dict:
    path = ckpt_dir / MANIFEST
    if not path.is_file():
        return {}
    data = read_json(path)
    _check_manifest(data, path)
    return data


# The JSON types of what gpt2port writes in manifest.json, which its readers (info, verify, export, download) rely
# on: a damaged file is named, not met as a TypeError deep inside one of them.
_MANIFEST_TYPES = {"tool": str, "version": str, "created": str, "dtype": str, "n_params": int, "source": dict,
                   "files": dict, "warnings": list, "saves": list, "exports": list}
_MANIFEST_ITEMS = {"warnings": str, "saves": dict, "exports": dict}
_SOURCE_FILE = {"name": str, "size": int, "sha256": str}


def _check_manifest(data: dict, path: Path) -> None:
    def refuse(key: str, kind: type) -> None:
        raise GPT2PortError(f"{path}: {key} is not {'an' if kind is int else 'a'} "
                            f"{ {str: 'string', int: 'integer', dict: 'JSON object', list: 'list'}[kind]}")
    for key, kind in _MANIFEST_TYPES.items():
        if key in data and (not isinstance(data[key], kind) or isinstance(data[key], bool)):
            refuse(key, kind)
    for key, kind in _MANIFEST_ITEMS.items():
        for i, item in enumerate(data.get(key, [])):
            if not isinstance(item, kind):
                refuse(f"{key}[{i}]", kind)
    files = data.get("source", {}).get("files", [])
    if not isinstance(files, list):
        refuse("source.files", list)
    for i, f in enumerate(files):
        if not isinstance(f, dict):
            refuse(f"source.files[{i}]", dict)
        for key, kind in _SOURCE_FILE.items():
            if not isinstance(f.get(key), kind) or isinstance(f.get(key), bool):
                refuse(f"source.files[{i}].{key}", kind)


def check_weights(path: Path, config: GPTConfig) -> Header:
    """Header of a gpt2port weights file, checked against the config: every tensor, right shape, float."""
    header = read_header(path)
    tag = header.metadata.get(FORMAT_KEY)
    if tag not in READABLE:
        raise GPT2PortError(f"{path}: not in gpt2port layout (metadata {FORMAT_KEY}={tag!r}; this version reads "
                            f"{', '.join(READABLE)})")
    n_tensors, _ = canonical.counts(config)
    if n_tensors > 2 * len(header.entries) + 16:  # before the expected table is built: its size is config.json's word
        raise GPT2PortError(f"{path}: holds {len(header.entries)} tensors; config.json implies {n_tensors}")
    expected = canonical.shapes(config)
    missing = [k for k in expected if k not in header.entries]
    extra = [k for k in header.entries if k not in expected]
    if missing or extra:
        raise GPT2PortError(f"{path}: keys do not match config.json (missing: {missing[:5]}, unexpected: {extra[:5]})")
    for k, shape in expected.items():
        e = header.entries[k]
        if e.shape != shape:
            raise GPT2PortError(f"{path}: tensor {k!r} has shape {e.shape}, config.json implies {shape}")
        if e.dtype not in FLOAT_DTYPES:
            raise GPT2PortError(f"{path}: tensor {k!r} has non-float dtype {e.dtype}")
    return header


def load_state(ckpt, dtype=None, device=None) -> tuple[Path, GPTConfig, dict[str, torch.Tensor]]:
    """(directory, config, tensors) of a checkpoint. Tensors are views of one private copy-on-write memory map of
    the file (nothing read until used, and changing them never writes to the file); converted only if a dtype or
    device is asked for."""
    ckpt_dir = resolve(ckpt)
    config = read_config(ckpt_dir)
    tensors = mmap_tensors(check_weights(ckpt_dir / WEIGHTS, config))
    dtype = parse_dtype(dtype)
    if dtype is not None or device is not None:
        tensors = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
    return ckpt_dir, config, tensors


# --- writing one -----------------------------------------------------------------------------------------------

def write(out: Path, config: GPTConfig, items, provenance: Callable[[], dict],
          tokenizer_files: list[Path] | Callable[[], list[Path]], force: bool = False, progress=None, reads=(),
          extra: Callable[[Path], object] | None = None) -> int:
    """A checkpoint directory at `out`, built aside and renamed into place when complete (see fsio).

    items: [(name, dtype, shape, produce)] in storage order, produce() called only when its tensor's turn comes.
    provenance() gives the manifest, asked for after the weights are written (a conversion hashes its source
    meanwhile); so are the tokenizer files, when a function gives them (one that rebuilds them does so inside the
    output being built). reads: the files the items come from (see fsio.staged_directory). extra(stage) writes
    more files into it (a run's adapter/) before the manifest records them all (records.py). Returns the weights
    file's size.
    """
    with staged_directory(out, force, reads) as stage:
        stream_safetensors(stage / WEIGHTS, items, metadata_for(config), progress)
        write_json(stage / CONFIG, config_json(config))
        for f in tokenizer_files() if callable(tokenizer_files) else tokenizer_files:
            copy_file(f, stage / f.name)
        if extra is not None:
            extra(stage)
        size = (stage / WEIGHTS).stat().st_size
        write_mark(stage / MANIFEST, provenance())
    return size


def write_export_manifest(stage: Path, layout: str, provenance: dict) -> None:
    """manifest.json of an export in another layout (hf, llmc, gguf): where its weights came from, what it holds,
    and gpt2port's mark on the directory (what --force may replace)."""
    write_mark(Path(stage) / MANIFEST, {**provenance, "tool": "gpt2port", "layout": layout})


def manifest(dtype: torch.dtype, config: GPTConfig, source: dict, warnings: list[str] | None = None) -> dict:
    """A new checkpoint's provenance: what wrote it, when, from what."""
    return {"tool": "gpt2port", "version": __version__, "created": _now(), "dtype": DTYPE_LABELS[dtype],
            "n_params": sum(math.prod(s) for s in canonical.shapes(config).values()), "source": source,
            "warnings": list(warnings or [])}


def derived_manifest(previous: dict, dtype: torch.dtype, event: str, origin: str) -> dict:
    """A checkpoint re-written from another (export, save after fine-tuning): its provenance, plus a note of this."""
    history = list(previous.get(event, []))
    history.append({"from": origin, "dtype": DTYPE_LABELS[dtype], "version": __version__, "created": _now()})
    return {**previous, "dtype": DTYPE_LABELS[dtype], event: history}


def _stored_order(origin, shapes: dict) -> list[str]:
    """The tensor order of the file a model was loaded from (a conversion keeps its source's order), so that saving
    an unchanged model reproduces that file byte for byte; canonical order otherwise."""
    if origin is not None and (Path(origin) / WEIGHTS).is_file():
        names = list(read_header(Path(origin) / WEIGHTS).entries)
        if sorted(names) == sorted(shapes):
            return names
    return list(shapes)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def save(model, out: str | Path, dtype=None, force: bool = False, tokenizer_from: str | Path | None = None,
         parent: str | Path | None = None) -> Path:
    """Write a model in memory (gpt2port's GPT, or any module whose state_dict has the canonical names and a
    `config`) as a checkpoint. A model loaded with from_pretrained and saved unchanged gives the same weights
    file, byte for byte; its provenance and tokenizer files are carried over (from `parent`, a checkpoint directory
    or NAME, when the model was not loaded from one), and manifest.json records the save with the parent's weights
    sha256. A model with its own head (tie_word_embeddings False) keeps it (format gpt2port/v2). Works from any
    device and dtype, and from a torch.compile'd model."""
    model = getattr(model, "_orig_mod", model)  # torch.compile wraps the module; its state_dict prefixes names
    if getattr(model, "quantized", None):
        raise GPT2PortError(f"{type(model).__name__}: its matrices were quantized to {model.quantized} at load, for "
                            f"inference only; save the checkpoint it was loaded from, or a model loaded in fp32, "
                            f"fp16 or bf16")
    config = model.config
    state = model.state_dict()
    missing = [k for k in canonical.shapes(config) if k not in state]
    if missing:
        raise GPT2PortError(f"{type(model).__name__}: has no {', '.join(missing[:5])}; save() writes gpt2port's "
                            f"own model (for another class, use gpt2port.save_from)")
    if config.tie_word_embeddings:
        head = state.get(canonical.HEAD)
        if head is not None and head is not state[canonical.EMBEDDING] and \
                not torch.equal(head, state[canonical.EMBEDDING]):
            raise GPT2PortError(f"{type(model).__name__}: lm_head is no longer tied to the token embedding, but its "
                                f"config says tied; set config.tie_word_embeddings = False to keep the head apart")
    origin = resolve(parent) if parent is not None else getattr(model, "checkpoint_dir", None)
    return save_state(state, config, out, dtype=dtype, force=force, origin=origin, tokenizer_from=tokenizer_from,
                      kind=f"in-memory {type(model).__name__}")


def save_state(state: dict[str, torch.Tensor], config: GPTConfig, out: str | Path, *, dtype=None,
               force: bool = False, origin: Path | None = None, tokenizer_from: str | Path | None = None,
               kind: str = "in-memory model", record: dict | None = None,
               extra: Callable[[Path], object] | None = None) -> Path:
    """Write canonical tensors as a checkpoint. origin: the checkpoint they were loaded from (its provenance and
    tokenizer carry over, its tensor order is kept); tokenizer_from: where the tokenizer files are otherwise;
    record: what made these weights (a fine-tuning run's data and settings), added to the manifest's entry; extra:
    see write."""
    out = Path(out)
    shapes = canonical.shapes(config)
    out_dtype = parse_dtype(dtype) or state[canonical.EMBEDDING].dtype
    if out_dtype not in DTYPE_LABELS:
        raise GPT2PortError(f"{kind}: parameters are {out_dtype}; pass dtype fp32, fp16 or bf16")
    tok_dir = Path(tokenizer_from) if tokenizer_from is not None else origin
    tokenizer_files = [tok_dir / n for n in TOKENIZER_FILES if (tok_dir / n).is_file()] if tok_dir else []
    parent_weights = Path(origin) / WEIGHTS if origin is not None else None
    if origin is not None and (Path(origin) / MANIFEST).is_file():
        prov = derived_manifest(read_manifest(Path(origin)), out_dtype, "saves", str(real(origin)))
    else:
        prov = manifest(out_dtype, config, {"path": None, "kind": kind})
    (prov["saves"][-1] if "saves" in prov else prov["source"]).update(record or {})

    def provenance(hasher: BackgroundHasher | None) -> dict:
        if hasher is not None and "saves" in prov:
            prov["saves"][-1]["from_weights"] = hasher.results()[0]
        return prov
    # Saving over the checkpoint a model was loaded from (with force) is safe: its tensors map a file that stays
    # readable until the new one is in place. Inside or around it is not.
    if origin is not None and real(out) != real(origin):
        refuse_overlap(out, Path(origin), "the checkpoint the model was loaded from")
    order = _stored_order(origin, shapes)
    items = [(name, out_dtype, shapes[name], (lambda t=state[name]: t.detach().cpu())) for name in order]
    # The parent's weights are hashed on a second thread while this checkpoint is written: the record of what it was
    # derived from names bytes, not only a path. Whatever fails, the session stops the hash.
    with Hashes() as hashes:
        hasher = BackgroundHasher([parent_weights], {}, hashes) if parent_weights and parent_weights.is_file() else None
        write(out, config, items, lambda: provenance(hasher), tokenizer_files, force, extra=extra)
    return out
