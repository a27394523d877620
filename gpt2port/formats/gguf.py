"""GGUF, llama.cpp's single-file format, through llama.cpp's own `gguf` package: a reader of tensors and metadata
key/values, and a streaming writer.

A GGUF file is a header, key/value metadata, tensor infos, then the aligned tensor bytes. The writer declares every
tensor first, writes the header, metadata and infos, then each tensor's bytes as it is produced, so one tensor is in
memory at a time. What the keys and tensors mean for GPT-2 is readers/gguf.py's and targets/gguf.py's. This module
is imported only when a .gguf is read or written: `gguf` costs ~0.3 s to import on top of torch, which
`import gpt2port` and the CLI's --help should not pay.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch

from gpt2port.errors import GPT2PortError
from gpt2port.formats.base import Reader, TensorInfo, refuse_lfs_pointer
from gpt2port.formats.gguf_scan import check_structure
from gpt2port.fsio import os_reason
from gpt2port.outfile import open_append

Q = gguf.GGMLQuantizationType
ENCODINGS = {"fp32": Q.F32, "fp16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}  # an encoding's name -> its GGML type
FILE_TYPES = {Q.F32: gguf.LlamaFileType.ALL_F32, Q.F16: gguf.LlamaFileType.MOSTLY_F16,
              Q.BF16: gguf.LlamaFileType.MOSTLY_BF16, Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}
TORCH_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
KEYS = gguf.Keys


def _nbytes(shape: tuple[int, ...], qtype: Q) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


# --- reading ------------------------------------------------------------------------------------------------------

class _PackageReader(gguf.GGUFReader):
    """gguf.GGUFReader over a plain ndarray view of its memory map. Every slice of an np.memmap runs Python code,
    and a GPT-2 GGUF's metadata is ~250k small slices (50k tokens, 50k merges): ~40 s, against ~5 s this way."""

    @property
    def data(self):
        return self._plain

    @data.setter
    def data(self, value):
        self._plain = value.view(np.ndarray)  # the view keeps the map alive


_V = gguf.GGUFValueType
_INTEGERS = {_V.UINT8, _V.INT8, _V.UINT16, _V.INT16, _V.UINT32, _V.INT32, _V.UINT64, _V.INT64}
_REALS = _INTEGERS | {_V.FLOAT32, _V.FLOAT64}


def _whole(f, path: Path):
    """The whole file as a read-only buffer (mapped: nothing is read until walked)."""
    import mmap

    try:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (ValueError, OSError) as e:
        raise GPT2PortError(f"{path}: cannot be mapped for reading ({e})") from None


def _refuse_overlaps(path: Path, tensors) -> None:
    """Every tensor's bytes its own, as safetensors requires: two infos pointing at the same bytes are a damaged or
    crafted file, not a model (a write through one would change the other)."""
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors if t.nbytes)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise GPT2PortError(f"{path}: tensors {a!r} and {b!r} overlap (the bytes of {b!r} start at {start}, "
                                f"before those of {a!r} end at {end})")


class GGUFFile(Reader):
    """A GGUF's f32/f16/bf16 tensors and its metadata, read on request by key. Subclasses open it in two steps,
    _open() then _list_tensors(), so that they can check the metadata before the tensors are listed."""

    def __init__(self, path: Path):
        self._open(path)
        self._list_tensors()

    def _open(self, path: Path) -> None:
        self.path = Path(path)
        self.files = [self.path]
        with open(self.path, "rb") as f:
            refuse_lfs_pointer(self.path, f.read(64))
            with _whole(f, self.path) as whole:
                check_structure(self.path, whole)
        try:
            self._gguf = _PackageReader(self.path)
        except Exception as e:  # the package raises ValueError, KeyError, IndexError... on a damaged file
            raise GPT2PortError(f"{self.path}: not a readable GGUF file (truncated or corrupt: "
                                f"{' '.join(str(e).split()) or type(e).__name__})") from None

    def _list_tensors(self) -> None:
        size = self.path.stat().st_size
        self.tensors, self._data = {}, {}
        for t in self._gguf.tensors:
            if t.tensor_type not in TORCH_TYPES:
                raise GPT2PortError(f"{self.path}: tensor {t.name!r} is quantized ({t.tensor_type.name}); gpt2port "
                                    f"imports F32, F16 and BF16 GGUF files only")
            if t.data_offset + t.n_bytes > size:
                raise GPT2PortError(f"{self.path}: truncated: tensor {t.name!r} ends at byte "
                                    f"{t.data_offset + t.n_bytes}, the file has {size}")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.tensors[t.name] = TensorInfo(t.name, TORCH_TYPES[t.tensor_type], shape, self.path,
                                              int(t.data_offset), int(t.n_bytes))
            self._data[t.name] = t.data
        _refuse_overlaps(self.path, self.tensors.values())
        self.metadata = {}
        self.warnings: list[str] = []

    def _field(self, key: str, required: bool = True):
        field = self._gguf.fields.get(key)
        if field is None:
            if required:
                raise GPT2PortError(f"{self.path}: GGUF metadata lacks {key!r}")
            return None
        try:
            return field.contents()
        except (UnicodeDecodeError, ValueError, IndexError):
            raise GPT2PortError(f"{self.path}: GGUF metadata {key!r} is damaged (not a readable value)") from None

    def _number(self, key: str, real: bool = False):
        """A size or eps from the metadata: one number (GPTConfig judges its value), or a refusal naming the key."""
        field = self._gguf.fields.get(key)
        kinds = _REALS if real else _INTEGERS
        if field is None or len(field.types) != 1 or field.types[0] not in kinds:
            self._field(key)  # names a missing key
            raise GPT2PortError(f"{self.path}: GGUF metadata {key!r} is not {'a number' if real else 'an integer'}")
        return field.contents()

    def _strings(self, key: str) -> list[str]:
        field = self._gguf.fields.get(key)
        if field is None or field.types != [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]:
            raise GPT2PortError(f"{self.path}: GGUF metadata {key!r} is not a list of strings")
        try:
            return field.contents()
        except UnicodeDecodeError:
            raise GPT2PortError(f"{self.path}: GGUF metadata {key!r} holds a string that is not UTF-8") from None

    def read(self, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        info = self.tensors[name]
        raw = torch.empty(info.nbytes, dtype=torch.uint8) if into is None else into[: info.nbytes]
        try:  # a copy out of the package's memory map, so the result outlives the reader
            raw.numpy()[:] = np.asarray(self._data[name]).reshape(-1).view(np.uint8)
        except (OSError, ValueError) as e:
            raise GPT2PortError(f"{self.path}: reading tensor {name!r} failed: {e}") from None
        return raw.view(info.dtype).reshape(info.shape)

    def close(self) -> None:
        self._data, self._gguf = {}, None  # drop the memory map
        super().close()


# --- writing ------------------------------------------------------------------------------------------------------

def _encode(tensor: torch.Tensor, qtype: Q) -> np.ndarray:
    if qtype == Q.Q8_0:
        return gguf.quants.quantize(tensor.float().contiguous().numpy(), qtype)
    t = tensor.to(TORCH_TYPES[qtype]).contiguous()
    # numpy has no bfloat16: its bytes go as uint16, which the writer takes for raw_dtype=BF16 as they are.
    return t.view(torch.int16).numpy().view(np.uint16) if qtype == Q.BF16 else t.numpy()


def write_gguf(path: Path, arch: str, plan, describe, progress=None) -> int:
    """Write `plan` [(key, shape, GGML type, produce)] as a GGUF of architecture `arch` at `path`, each produce()
    called only when its bytes are due; describe(writer) adds the metadata to the package's GGUFWriter before
    anything is written. Returns the file's size."""
    names = {q: name for name, q in ENCODINGS.items()}
    for key, shape, qtype, _ in plan:
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if shape[-1] % block:
            raise GPT2PortError(f"{path.parent}: {names[qtype]} needs rows whose length divides by {block}; "
                                f"{key} has rows of {shape[-1]}")
    writer = gguf.GGUFWriter(path, arch)
    try:
        out = open_append(path)
    except OSError as e:
        raise GPT2PortError(f"{path}: cannot create: {os_reason(e)}") from None
    try:
        describe(writer)
        for key, shape, qtype, _ in plan:
            writer.add_tensor_info(key, shape, _numpy_dtype(qtype), _nbytes(shape, qtype), qtype)
        # The gguf writer writes through whatever file object it holds once described: ours, so that the weights go
        # out as every large output does (gpt2port/outfile.py). Its own open would also log a plan of the file.
        writer.fout, writer.state = [out], gguf.WriterState.EMPTY
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        total, done = sum(_nbytes(s, q) for _, s, q, _ in plan), 0
        for key, shape, qtype, produce in plan:
            writer.write_tensor_data(_encode(produce(), qtype).view(_Raw))
            done += _nbytes(shape, qtype)
            if progress:
                progress(done, total)
        written = out.tell()
        out.close()
    except OSError as e:
        raise GPT2PortError(f"{path}: write failed: {os_reason(e)}") from None
    finally:
        out.abort()  # after close() above this does nothing; on a failure it stops the writer and closes the file
        writer.fout = None
    # Re-parsing the metadata would cost seconds; every byte went through the file object, so its length says all.
    if path.stat().st_size != written:
        raise GPT2PortError(f"{path}: post-write check failed: {path.stat().st_size} bytes on disk, {written} written")
    return written


class _Raw(np.ndarray):
    """A tensor's bytes for the gguf writer, which hands each tensor to ndarray.tofile: numpy's tofile wants an OS
    file, and the writer holds an outfile appender, so the bytes are handed to its write() instead."""

    def tofile(self, fid, *args, **kwargs) -> None:
        fid.write(memoryview(np.ascontiguousarray(self.view(np.ndarray))).cast("B"))


def _numpy_dtype(qtype: Q) -> np.dtype:
    return np.dtype({Q.F32: np.float32, Q.F16: np.float16, Q.BF16: np.uint16, Q.Q8_0: np.float32}[qtype])
