"""Convert and export, one path: a source's reader and layout -> canonical tensors -> a target layout and writer.

sources.py opens the input, layouts/ decide where each tensor goes and how it is reshaped, formats/ stream the
bytes, fsio.py makes sure nothing is left half-written. A tensor is read, transformed, cast and written before the
next is read, so peak memory is about two tensors, not a model.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from gpt2port import checkpoint
from gpt2port.activations import expressible
from gpt2port.dtypes import DTYPE_LABELS, parse_dtype
from gpt2port.errors import GPT2PortError
from gpt2port.formats import FLOAT_DTYPES
from gpt2port.formats.base import Reader
from gpt2port.formats.prefetch import Streamed
from gpt2port.fsio import refuse_hf_cache, refuse_overlap, staged_directory
from gpt2port.hashing import Hashes
from gpt2port.layouts import GPT2PORT, canonical, get as get_layout
from gpt2port.layouts.transforms import merge
from gpt2port.sources import Source, open_source
from gpt2port.targets import REGISTRY


@dataclass
class ConvertResult:
    out: Path
    layout: str
    n_params: int
    dtype: torch.dtype | str  # a str for an encoding of the target's own (Target.encodings: "q8_0")
    bytes_written: int
    seconds: float
    warnings: list[str] = field(default_factory=list)
    dequantized: str | None = None  # the source's stored encoding ("q8_0") its weights were dequantized from
    proof: dict = field(default_factory=dict)  # what the target's own runtime computed from the output, when it ran


@dataclass
class Job:
    """One conversion, as a target's writer sees it: the opened source, the planned tensors, where and how."""
    source: Source
    out: Path
    items: list  # [(key, dtype, shape, produce)] in the order to write them
    dtype: torch.dtype
    force: bool
    progress: Callable[[int, int], None] | None
    warnings: list[str]
    facts: dict  # provenance for a manifest: what the reading learned, and what the caller added
    known_sha256: dict[str, str]
    options: dict  # target-specific switches, passed through from convert(..., options=)
    hashes: Hashes  # this conversion's hashing session (the source's reader offers to it); closed by convert()
    proof: dict = field(default_factory=dict)  # set by a writer that runs its output: the numbers, for the manifest

    def staged(self):
        """The output directory being built (fsio.staged_directory), refused if it would replace what is read."""
        return staged_directory(self.out, self.force, self.source.read_files())

    def write_manifest(self, stage: Path, layout: str) -> None:
        """An export's manifest.json, written last into `stage`: the checkpoint's provenance carried over, or the
        source's when converted straight from one."""
        source = self.source
        if source.layout is GPT2PORT:
            prov = checkpoint.derived_manifest(checkpoint.read_manifest(source.root), self.dtype, "exports",
                                               str(source.root.resolve()))
        else:
            prov = checkpoint.manifest(self.dtype, source.config, {"path": str(source.path.resolve()), **self.facts})
        encoding = self.options.get("encoding")
        checkpoint.write_export_manifest(stage, layout, {**prov, **({"encoding": encoding} if encoding else {}),
                                                         **({"proof": self.proof} if self.proof else {}),
                                                         "warnings": self.warnings})


def convert(src: str | Path, out: str | Path, dtype=None, force: bool = False, to: str = "gpt2port",
            provenance: dict | None = None, known_sha256: dict[str, str] | None = None,
            progress: Callable[[int, int], None] | None = None, options: dict | None = None) -> ConvertResult:
    """Convert the GPT-2 weights at `src` (a Hugging Face repo directory or weights file, a gpt2port checkpoint, an
    llm.c model file or a GGUF file) into the directory `out`, in layout `to` (one of targets.REGISTRY: "gpt2port",
    "hf" for GPT2LMHeadModel.from_pretrained, "llmc", "gguf", "onnx").

    dtype: fp32/fp16/bf16 (default: the source's), or an encoding of the target's own (Target.encodings).
    provenance: extra facts for the manifest (the Hub repo and commit a download came from). known_sha256: file
    name -> sha256 already established (a verified download), so it is not hashed again. progress(done_bytes,
    total_bytes) is called after each tensor. options: switches of the target layout's writer (Target.options).
    """
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    if to not in REGISTRY:
        raise GPT2PortError(f"unknown output layout {to!r} (known: {', '.join(REGISTRY)})")
    target, writer = get_layout(REGISTRY[to].layout or to), REGISTRY[to].writer()
    encoding = dtype.lower() if isinstance(dtype, str) and dtype.lower() in REGISTRY[to].encodings else None
    if encoding:  # produced in fp32; the writer encodes
        options, dtype = {**(options or {}), "encoding": encoding}, torch.float32
    elif isinstance(dtype, str) and any(dtype.lower() in t.encodings for t in REGISTRY.values()):
        owners = " or ".join(f"--to {n}" for n, t in REGISTRY.items() if dtype.lower() in t.encodings)
        raise GPT2PortError(f"dtype {dtype!r} is for {owners} only; the {to} layout takes fp32, fp16 or bf16")
    with Hashes() as hashes, open_source(src, hashes) as source:
        refuse_overlap(out, source.root)
        refuse_hf_cache(out)
        if not expressible(source.config.activation, REGISTRY[to]):
            raise GPT2PortError(f"{source.where}: its MLP's activation is {source.config.activation!r}; {to} files "
                                f"always compute GPT-2's tanh GELU, so this export would be another model (--to hf "
                                f"keeps the activation)")
        out_dtype = parse_dtype(dtype) or source.dtype()
        warnings = source.warnings()
        # Read as the values the file encodes (q8_0: d * q), not the weights it was quantized from: said as such.
        dequantized = ", ".join(sorted({t.encoding for t in source.reader.tensors.values() if t.encoding})) or None
        items, dropped, head = _items(source, target, out_dtype, warnings, streamed=REGISTRY[to].streamed)
        if out_dtype not in DTYPE_LABELS:
            raise GPT2PortError(f"{source.where}: weights are {out_dtype}; pass --dtype fp32, fp16 or bf16")
        facts = {"dropped_keys": len(dropped), "head": "checked equal to wte" if head else "absent (tied)",
                 **({"encoding": dequantized} if dequantized else {}), **(provenance or {})}
        job = Job(source, out, items, out_dtype, force, progress, warnings, facts, known_sha256 or {}, options or {},
                  hashes)
        size = writer(job)
    n_params = sum(math.prod(s) for s in canonical.shapes(source.config).values())
    return ConvertResult(out, to, n_params, encoding or out_dtype, size, time.perf_counter() - t0, warnings,
                         dequantized, job.proof)


def export(ckpt, out: str | Path, to: str = "gpt2port", dtype=None, force: bool = False,
           progress: Callable[[int, int], None] | None = None, options: dict | None = None) -> ConvertResult:
    """A converted checkpoint (directory or NAME) re-written in another dtype or another layout."""
    ckpt_dir = checkpoint.resolve(ckpt)
    refuse_overlap(Path(out), ckpt_dir, "the checkpoint itself")
    return convert(ckpt_dir, out, dtype=dtype, force=force, to=to, progress=progress, options=options)


# --- reading: every canonical tensor, in the order the source's bytes lie --------------------------------------

def _items(source: Source, target, out_dtype: torch.dtype, warnings: list[str],
           streamed: bool = False) -> tuple[list, list[str], str | None]:
    """([(key, dtype, shape, produce)] of the target, dropped source keys, the source's untied head key or None).
    Each produce() reads and transforms its tensor when called; warnings collects NaN/Inf findings. streamed: for a
    writer that takes prefetch.Streamed items, a tensor the target stores byte for byte as the source does comes as
    one (copied from file to file in pieces, never whole in memory)."""
    config, reader = source.config, source.reader
    reads, dropped, head = source.layout.plan_read(list(reader.tensors), config, source.where)
    shapes = canonical.shapes(config)
    parts: dict[str, list] = {}
    for r in reads:
        info = reader.tensors[r.key]
        want = r.transform.layout_shape(shapes[r.target])
        if info.shape != want:
            raise GPT2PortError(f"{info.file}: tensor {r.key!r} has shape {info.shape}, but "
                                f"{source.config_path or 'the inferred config'} implies {want}")
        if info.dtype not in FLOAT_DTYPES:
            raise GPT2PortError(f"{info.file}: tensor {r.key!r} has non-float dtype {info.dtype}")
        parts.setdefault(r.target, []).append(r)
    writes = target.plan_write(config)
    plain = _plain(source, parts, writes, out_dtype, head) if streamed else set()
    # One read buffer for the tensors read whole, as large as the largest of them (at 1.5B the token embedding
    # streams instead): faulting in fresh memory for every tensor is slow on some machines (docs/performance.md).
    buffer = torch.empty(max((reader.tensors[r.key].nbytes for name, rs in parts.items() if name not in plain
                              for r in rs), default=0), dtype=torch.uint8)

    def produce(name: str) -> torch.Tensor:
        tensors = []
        for r in parts[name]:
            whole = len(parts[name]) == 1 and buffer.numel() >= reader.tensors[r.key].nbytes
            t = reader.read(r.key, into=buffer if whole else None)
            if not all_finite(t):
                warnings.append(_non_finite(reader, r.key))
            else:
                refuse_overflow(t, out_dtype, reader.tensors[r.key].file, r.key)
            tensors.append((r.transform, t))
        whole = merge(tensors, shapes[name])
        if head is not None and name == canonical.EMBEDDING:
            _check_head_is_tied(source, head, whole)
        return whole

    # Read in file order, so a large source streams sequentially through the page cache.
    rank = {f: i for i, f in enumerate(reader.files)}
    first = {name: min((rank.get(reader.tensors[r.key].file, 0), reader.tensors[r.key].offset) for r in rs)
             for name, rs in parts.items()}
    writes = target.order(writes) if target.order else sorted(writes, key=lambda w: first[w.source])
    cache: dict[str, torch.Tensor] = {}

    def produce_write(w):
        def run():
            if w.source not in cache:  # several layout tensors may come from one canonical tensor (q, k, v parts)
                cache.clear()
                cache[w.source] = produce(w.source)
            return w.transform.to_layout(cache[w.source])

        def stream():
            key, found = parts[w.source][0].key, []

            def check(piece: torch.Tensor) -> None:
                if not found and not all_finite(piece):
                    found.append(key)
                    warnings.append(_non_finite(reader, key))
            return Streamed(reader.tensors[key].nbytes, lambda: reader.stream(key), check, run)
        return stream if w.source in plain else run

    return [(w.key, out_dtype, w.shape, produce_write(w)) for w in writes], dropped, head


def _plain(source: Source, parts: dict, writes: list, out_dtype: torch.dtype, head: str | None) -> set[str]:
    """The canonical tensors that go from source to target byte for byte: read from one stored tensor, in the
    output's dtype, through transforms that keep bytes both ways, from a format that can stream them."""
    if type(source.reader).stream is Reader.stream:
        return set()
    moved = {w.source for w in writes if not w.transform.keeps_bytes}
    return {name for name, rs in parts.items()
            if len(rs) == 1 and rs[0].transform.keeps_bytes and name not in moved
            and source.reader.tensors[rs[0].key].dtype == out_dtype
            and source.reader.tensors[rs[0].key].encoding is None  # q8_0 bytes are not float32's
            and not (head is not None and name == canonical.EMBEDDING)}  # the tied-head check reads it whole


def _non_finite(reader, key: str) -> str:
    return f"{reader.tensors[key].file}: tensor {key!r} contains NaN or Inf"


def canonical_items(source: Source, dtype=None) -> list:
    """A source's canonical tensors as [(name, dtype, shape, produce)], in the order its bytes lie; produce() reads
    and returns one (possibly into a buffer the next call reuses: copy what you keep)."""
    return _items(source, GPT2PORT, parse_dtype(dtype) or source.dtype(), [])[0]


def _check_head_is_tied(source: Source, head: str, wte: torch.Tensor) -> None:
    lm_head = source.reader.read(head)
    if lm_head.shape != wte.shape or not torch.equal(lm_head, wte):
        raise GPT2PortError(f"{source.reader.tensors[head].file}: {head!r} differs from "
                            f"{source.layout.key_for(canonical.EMBEDDING)}; GPT-2 ties the head to the token "
                            f"embedding, so converting would change the model")


def refuse_overflow(t: torch.Tensor, dtype: torch.dtype, file, key: str) -> None:
    """Refuse a finite tensor holding a value beyond `dtype`'s range (1e30 into fp16): cast, it would be written as
    Inf in silence."""
    if not dtype.is_floating_point or t.dtype == dtype or torch.finfo(dtype).max >= torch.finfo(t.dtype).max \
            or not t.numel():
        return
    lo, hi = torch.aminmax(t)
    top = max(-float(lo), float(hi))
    if top > torch.finfo(dtype).max:
        from gpt2port.dtypes import label

        raise GPT2PortError(f"{file}: tensor {key!r} holds {top:.3g}, beyond {label(dtype)}'s largest value "
                            f"({torch.finfo(dtype).max:.6g}): it would be written as Inf; keep fp32, or use bf16")


def all_finite(tensor: torch.Tensor) -> bool:
    # A sum is non-finite if any element is (NaN and Inf propagate); the exact element-wise check, much slower,
    # runs only to rule out a sum that merely overflowed.
    if bool(torch.isfinite(tensor.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(tensor).all())
