"""Hugging Face GPT-2 files -> a gpt2port checkpoint directory, one tensor at a time.

sources.py reads, keymap.py decides where each tensor goes, writer.py streams it out; this module strings them
together and writes config.json, the tokenizer files and manifest.json beside the weights.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from gpt2port import __version__
from gpt2port.checkpoint import (CONFIG, DTYPE_LABELS, MANIFEST, WEIGHTS, config_json, parse_dtype)
from gpt2port.errors import GPT2PortError
from gpt2port.keymap import FORMAT_TAG, HF_EMBEDDING, apply, expected_shapes, plan_hf_to_ours, source_shape, strip_prefix
from gpt2port.safetensors_format import FLOAT_DTYPES
from gpt2port.sources import Source, open_source
from gpt2port.writer import copy_file, staged_directory, stream_safetensors, write_json

HASH_CHUNK = 16 << 20


@dataclass
class ConvertResult:
    out: Path
    n_params: int
    dtype: torch.dtype
    bytes_written: int
    seconds: float
    warnings: list[str] = field(default_factory=list)


def convert(src: str | Path, out: str | Path, dtype=None, force: bool = False, provenance: dict | None = None,
            known_sha256: dict[str, str] | None = None,
            progress: Callable[[int, int], None] | None = None) -> ConvertResult:
    """Convert the HF checkpoint at `src` into the gpt2port directory `out`.

    provenance: extra facts for the manifest (e.g. the Hub repo and commit a download came from).
    known_sha256: file name -> sha256 already established (a verified download), so it is not hashed again.
    progress(done_bytes, total_bytes) is called after each tensor is written.
    """
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    with open_source(src) as source:
        check_destination(source, out)
        config = source.config
        where = ", ".join(str(f) for f in source.weight_files)
        mappings, dropped, head = plan_hf_to_ours(list(source.tensors), config, where)
        out_dtype = parse_dtype(dtype) or source.dtype()
        shapes = expected_shapes(config)
        for m in mappings:
            t = source.tensors[m.source]
            want = source_shape(m, shapes[m.target])
            if t.shape != want:
                raise GPT2PortError(f"{t.file}: tensor {m.source!r} has shape {t.shape}, but "
                                    f"{source.config_path or 'the inferred config'} implies {want}")
            if t.dtype not in FLOAT_DTYPES:
                raise GPT2PortError(f"{t.file}: tensor {m.source!r} has non-float dtype {t.dtype}")
        if out_dtype not in DTYPE_LABELS:
            raise GPT2PortError(f"{where}: weights are {out_dtype}; pass --dtype fp32, fp16 or bf16")
        # Read in file order, so a large source streams sequentially through the page cache.
        file_rank = {f: i for i, f in enumerate(source.weight_files)}
        ordered = sorted(mappings, key=lambda m: (file_rank[source.tensors[m.source].file],
                                                  source.tensors[m.source].entry.offset
                                                  if source.tensors[m.source].entry else 0))
        warnings: list[str] = []

        read_buffer = torch.empty(max(source.tensors[m.source].entry.nbytes if source.tensors[m.source].entry else 0
                                      for m in ordered), dtype=torch.uint8)

        def produce(m):
            def read():
                tensor = source.read(m.source, into=read_buffer)
                if not all_finite(tensor):
                    warnings.append(f"{source.tensors[m.source].file}: tensor {m.source!r} contains NaN or Inf")
                if head is not None and strip_prefix(m.source) == HF_EMBEDDING:
                    _check_head_is_tied(source, head, tensor)
                return apply(m.transform, tensor)
            return read

        items = [(m.target, out_dtype, shapes[m.target], produce(m)) for m in ordered]
        hasher = _SourceHasher(source.weight_files + source.side_files(), known_sha256 or {})
        try:
            with staged_directory(out, force) as stage:
                stream_safetensors(stage / WEIGHTS, items, dict(FORMAT_TAG), progress)
                write_json(stage / CONFIG, config_json(config))
                for f in source.tokenizer_files():
                    copy_file(f, stage / f.name)
                n_params = sum(_numel(s) for s in shapes.values())
                write_json(stage / MANIFEST, {
                    "tool": "gpt2port",
                    "version": __version__,
                    "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "dtype": DTYPE_LABELS[out_dtype],
                    "n_params": n_params,
                    "source": {
                        "path": str(src.resolve()),
                        "dtype": str(source.dtype()).removeprefix("torch."),
                        "files": hasher.results(),
                        "dropped_keys": len(dropped),
                        "head": "checked equal to wte" if head else "absent (tied)",
                        **(provenance or {}),
                    },
                    "files": {WEIGHTS: (stage / WEIGHTS).stat().st_size},
                    "warnings": warnings,
                })
        except BaseException:
            hasher.cancel()  # a failed conversion needs no digests: stop reading the source now
            raise
    return ConvertResult(out, n_params, out_dtype, (out / WEIGHTS).stat().st_size, time.perf_counter() - t0, warnings)


def check_destination(source: Source, out: Path) -> None:
    """Refuse outputs that could overwrite or pollute the source: the source itself, inside it, or the HF cache."""
    out_abs = out.resolve()
    src_abs = source.path.resolve()
    src_root = source.root.resolve()
    if out_abs == src_abs or out_abs == src_root or src_root in out_abs.parents or out_abs in src_abs.parents:
        raise GPT2PortError(f"{out}: output must not be the source or inside/around it ({source.path})")
    cache = _hf_cache_dir()
    if cache is not None and (out_abs == cache or cache in out_abs.parents):
        raise GPT2PortError(f"{out}: output must not be inside the Hugging Face cache ({cache})")


def _hf_cache_dir() -> Path | None:
    cache = os.environ.get("HF_HUB_CACHE")
    if not cache:
        home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
        cache = os.path.join(home, "hub")
    return Path(cache).expanduser().resolve()


def _check_head_is_tied(source: Source, head: str, wte: torch.Tensor) -> None:
    lm_head = source.read(head)
    if lm_head.shape != wte.shape or not torch.equal(lm_head, wte):
        raise GPT2PortError(f"{source.tensors[head].file}: {head!r} differs from wte.weight; gpt2port ties the head "
                            f"to the token embedding, so converting would change the model")


def all_finite(tensor: torch.Tensor) -> bool:
    # A sum is non-finite if any element is (NaN and Inf propagate); an exact element-wise check, ~20x slower,
    # runs only to rule out a sum that merely overflowed.
    if bool(torch.isfinite(tensor.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(tensor).all())


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _SourceHasher:
    """sha256 of each source file, computed on a second thread while the conversion runs on the first."""

    def __init__(self, files: list[Path], known: dict[str, str]):
        self._files = files
        self._known = known
        self._digests: dict[Path, str] = {}
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for f in self._files:
                if self._stop.is_set():
                    return
                if f.name in self._known:
                    continue
                h = hashlib.sha256()
                with open(f, "rb") as fh:
                    while not self._stop.is_set() and (chunk := fh.read(HASH_CHUNK)):
                        h.update(chunk)
                self._digests[f] = h.hexdigest()
        except BaseException as e:  # noqa: BLE001 - reported on the main thread by results()
            self._error = e

    def cancel(self) -> None:
        """Stop reading the source (the conversion failed; no manifest will need the digests)."""
        self._stop.set()
        self._thread.join()

    def results(self) -> list[dict]:
        self._thread.join()
        if self._error is not None:
            raise GPT2PortError(f"hashing the source failed: {self._error}")
        return [{"name": f.name, "size": f.stat().st_size, "sha256": self._known.get(f.name) or self._digests[f]}
                for f in self._files]
