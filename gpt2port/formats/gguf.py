"""GGUF, llama.cpp's single-file format: a reader of tensors and metadata key/values, and a streaming writer.

A GGUF file is a header, key/value metadata, tensor infos, then the aligned tensor bytes. Reading: the header is
walked by formats/gguf_scan.py (bounded by the file's size, and far faster than the `gguf` package's reader), the
tensors read with pread (quantized ones then dequantized to float32, formats/gguf_quants.py). Writing: llama.cpp's
own `gguf` package, through its public API only, writes the header, metadata and tensor infos; the tensors' bytes
then follow at the offsets that header gives, each as it is produced (quantized by formats/gguf_quants.py), so one
tensor is in memory at a time. What the keys and tensors mean for GPT-2
is readers/gguf.py's and targets/gguf.py's. This module is imported only when a .gguf is read or written: `gguf`
costs ~0.3 s to import on top of torch, which `import gpt2port` and the CLI's --help should not pay.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch

from gpt2port import hashing, inputs
from gpt2port.errors import GPT2PortError
from gpt2port.formats import gguf_quants
from gpt2port.formats.base import TensorInfo, read_bytes, refuse_lfs_pointer
from gpt2port.formats.gguf_scan import read_header, value
from gpt2port.formats.safetensors import READ_PIECE, PreadReader
from gpt2port.fsio import os_reason
from gpt2port.outfile import open_append

Q = gguf.GGMLQuantizationType
# a float encoding's name -> its GGML type (the quantized file types: targets/gguf_recipe.py)
ENCODINGS = {"fp32": Q.F32, "fp16": Q.F16, "bf16": Q.BF16}
FILE_TYPES = {Q.F32: gguf.LlamaFileType.ALL_F32, Q.F16: gguf.LlamaFileType.MOSTLY_F16,
              Q.BF16: gguf.LlamaFileType.MOSTLY_BF16}
TORCH_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
# read as float32 values (TensorInfo.encoding names the stored form: "q4_k")
DEQUANTIZED = {q: q.name.lower() for q in gguf_quants.TYPES}
KEYS = gguf.Keys


def _nbytes(shape: tuple[int, ...], qtype: Q) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


# --- reading ------------------------------------------------------------------------------------------------------

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


class GGUFFile(PreadReader):
    """A GGUF's f32/f16/bf16 tensors (read with pread, as safetensors' are; quantized ones read so, then
    dequantized to float32) and its metadata, read on request by key. Subclasses open it in two steps, _open() then
    _list_tensors(), so that they can check the metadata before the tensors are listed."""

    _map = None

    def __init__(self, path: Path):
        self._open(path)
        self._list_tensors()

    def _open(self, path: Path) -> None:
        self.path = Path(path)
        self.files = [self.path]
        with inputs.open_binary(self.path, what="a GGUF file") as f:
            refuse_lfs_pointer(self.path, f.read(64))
            self._map = _whole(f, self.path)  # kept for the metadata values, decoded when asked for
        try:
            self.header = read_header(self.path, self._map)
        except BaseException:
            self.close()
            raise

    def _list_tensors(self) -> None:
        self.tensors = {}
        for t in self.header.tensors:
            try:
                qtype = Q(t.ggml_type)
            except ValueError:
                unknown = f"{self.path}: tensor {t.name!r} has an unknown GGML type ({t.ggml_type})"
                raise GPT2PortError(unknown) from None
            if qtype not in TORCH_TYPES and qtype not in DEQUANTIZED:
                raise GPT2PortError(f"{self.path}: tensor {t.name!r} is quantized ({qtype.name}); gpt2port "
                                    f"imports F32, F16, BF16 and {', '.join(q.name for q in DEQUANTIZED)} only")
            shape = tuple(reversed(t.dims))
            block = gguf.GGML_QUANT_SIZES[qtype][0]
            if block > 1 and (not shape or shape[-1] % block):  # a block never spans two rows
                raise GPT2PortError(f"{self.path}: tensor {t.name!r} is {qtype.name} with rows of "
                                    f"{shape[-1] if shape else 0} values; {qtype.name} needs a multiple of {block}")
            nbytes = _nbytes(shape, qtype)  # the whole blocks' bytes: checked against the file before any is read
            if t.offset + nbytes > self.header.size:
                raise GPT2PortError(f"{self.path}: truncated: tensor {t.name!r} ends at byte "
                                    f"{t.offset + nbytes}, the file has {self.header.size}")
            dtype, encoding = TORCH_TYPES.get(qtype, torch.float32), DEQUANTIZED.get(qtype)
            self.tensors[t.name] = TensorInfo(t.name, dtype, shape, self.path, t.offset, nbytes, encoding)
        _refuse_overlaps(self.path, self.tensors.values())
        self.metadata = {}
        self.warnings: list[str] = []

    def read(self, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        info = self.tensors[name]
        if info.encoding is None:
            return super().read(name, into)
        if self._loans is None:
            self._loans = hashing.Loans()
        # The stored blocks read as every tensor's bytes are (pread, hashed on the way), then dequantized.
        raw = read_bytes(self.stream(name), into, self._loans, READ_PIECE)
        out = torch.empty(info.shape, dtype=torch.float32)
        gguf_quants.dequantize(raw.numpy(), Q[info.encoding.upper()], out.numel(), out.numpy().reshape(-1))
        return out

    def _string(self, key: str, required: bool = True) -> str | None:
        field = self.header.fields.get(key)
        if field is None:
            if required:
                raise GPT2PortError(f"{self.path}: GGUF metadata lacks {key!r}")
            return None
        if field.kind != _V.STRING:
            raise GPT2PortError(f"{self.path}: GGUF metadata {key!r} is not a string")
        try:
            return value(self._map, field).decode("utf-8")
        except UnicodeDecodeError:
            raise GPT2PortError(f"{self.path}: GGUF metadata {key!r} is not UTF-8") from None

    def _number(self, key: str, real: bool = False):
        """A size or eps from the metadata: one number (GPTConfig judges its value), or a refusal naming the key."""
        field = self.header.fields.get(key)
        if field is None:
            raise GPT2PortError(f"{self.path}: GGUF metadata lacks {key!r}")
        if field.kind not in (_REALS if real else _INTEGERS):
            raise GPT2PortError(f"{self.path}: GGUF metadata {key!r} is not {'a number' if real else 'an integer'}")
        return value(self._map, field)

    def _strings(self, key: str, most: int) -> list[str]:
        """A list of at most `most` strings (checked before any is read: each costs far more memory decoded than
        its 8 bytes in the file)."""
        field = self.header.fields.get(key)
        if field is None or field.kind != _V.ARRAY or field.item != _V.STRING:
            raise GPT2PortError(f"{self.path}: GGUF metadata {key!r} is not a list of strings")
        if field.count > most:
            raise GPT2PortError(f"{self.path}: GGUF metadata {key!r} lists {field.count:,} strings; at most {most:,} "
                                f"can belong to this model")
        try:
            return [s.decode("utf-8") for s in value(self._map, field)]
        except UnicodeDecodeError:
            raise GPT2PortError(f"{self.path}: GGUF metadata {key!r} holds a string that is not UTF-8") from None

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        super().close()


# --- writing ------------------------------------------------------------------------------------------------------

def _encode(tensor: torch.Tensor, qtype: Q) -> np.ndarray:
    if qtype in DEQUANTIZED:  # on as many threads as PyTorch computes with
        return gguf_quants.quantize(tensor.float().contiguous().numpy(), qtype, torch.get_num_threads())
    t = tensor.to(TORCH_TYPES[qtype]).contiguous()
    # numpy has no bfloat16: its bytes go as uint16, as the gguf package takes them for BF16.
    return t.view(torch.int16).numpy().view(np.uint16) if qtype == Q.BF16 else t.numpy()


def write_gguf(path: Path, arch: str, plan, describe, progress=None) -> int:
    """Write `plan` [(key, shape, GGML type, produce)] as a GGUF of architecture `arch` at `path` (which must not
    exist), each produce() called only when its bytes are due; describe(writer) adds the metadata to the gguf
    package's GGUFWriter. Returns the file's size."""
    for key, shape, qtype, _ in plan:
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if shape[-1] % block:
            raise GPT2PortError(f"{path.parent}: {qtype.name.lower()} needs rows whose length divides by {block}; "
                                f"{key} has rows of {shape[-1]}")
    head = _header(path, arch, plan, describe)
    layout = read_header(path, head)  # where the header says each tensor's bytes go
    if [t.name for t in layout.tensors] != [key for key, *_ in plan]:
        raise RuntimeError(f"{path}: the gguf writer listed the tensors in another order than given")
    try:
        out = open_append(path)
    except OSError as e:
        raise GPT2PortError(f"{path}: cannot create: {os_reason(e)}") from None
    try:
        out.write(head)
        total, done = sum(_nbytes(s, q) for _, s, q, _ in plan), 0
        for entry, (key, shape, qtype, produce) in zip(layout.tensors, plan):
            out.write(bytes(entry.offset - out.tell()))  # the alignment padding before it
            data = np.ascontiguousarray(_encode(produce(), qtype))
            if data.nbytes != _nbytes(shape, qtype):
                raise RuntimeError(f"{path}: {key} came as {data.nbytes} bytes, {_nbytes(shape, qtype)} declared")
            out.write(memoryview(data).cast("B"))
            done += data.nbytes
            if progress:
                progress(done, total)
        out.write(bytes(-out.tell() % layout.alignment))  # the last tensor padded too, as the gguf writer pads it
        written = out.tell()
        out.close()
    except OSError as e:
        raise GPT2PortError(f"{path}: write failed: {os_reason(e)}") from None
    finally:
        out.abort()  # after close() above this does nothing; on a failure it stops the writer and closes the file
    # Every byte went through the file object, and the header was read back above: the length says the rest.
    if path.stat().st_size != written:
        raise GPT2PortError(f"{path}: post-write check failed: {path.stat().st_size} bytes on disk, {written} written")
    return written


def _header(path: Path, arch: str, plan, describe) -> bytes:
    """The file's header, key/values and tensor infos, as the gguf package's GGUFWriter writes them: written to
    `path` by the package, read back and removed, so that the weights can then go out as every large output does
    (gpt2port/outfile.py) after these bytes."""
    writer = gguf.GGUFWriter(path, arch)
    describe(writer)
    for key, shape, qtype, _ in plan:
        writer.add_tensor_info(key, shape, _numpy_dtype(qtype), _nbytes(shape, qtype), qtype)
    try:
        open(path, "xb").close()  # never over a file that exists: the package's own open would truncate it
    except OSError as e:
        raise GPT2PortError(f"{path}: cannot create: {os_reason(e)}") from None
    try:
        try:
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
        finally:
            writer.close()
        return path.read_bytes()
    except OSError as e:
        raise GPT2PortError(f"{path}: write failed: {os_reason(e)}") from None
    finally:
        path.unlink(missing_ok=True)


def _numpy_dtype(qtype: Q) -> np.dtype:
    return np.dtype({Q.F16: np.float16, Q.BF16: np.uint16}.get(qtype, np.float32))  # blocks: the values' shape
