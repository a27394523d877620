"""The safetensors file layout, read and checked strictly: header, dtypes, offsets.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON ({name: {dtype, shape,
data_offsets}}, plus optional string "__metadata__"), then the tensor bytes. gpt2port reads and writes this
layout itself so it can stream (pread one tensor at a time, never map a 6 GB file into its RSS) and so a
damaged file is named precisely instead of failing deep inside a library.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2port.errors import GPT2PortError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = {torch.float32, torch.float16, torch.bfloat16, torch.float64}
MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's own limit
LFS_POINTER_PREFIX = b"version https://git-lfs"


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class Header:
    path: Path
    entries: dict[str, TensorEntry]  # in file order
    metadata: dict[str, str]
    data_start: int
    file_size: int


def read_header(path: Path) -> Header:
    """Parse and validate a safetensors header; raise a one-line error naming `path` on any inconsistency."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if head == LFS_POINTER_PREFIX[:8] and f.read(len(LFS_POINTER_PREFIX) - 8) == LFS_POINTER_PREFIX[8:]:
                raise GPT2PortError(f"{path}: is a Git LFS pointer file, not the weights (fetch the real file)")
            f.seek(8)
            if len(head) < 8:
                raise GPT2PortError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > MAX_HEADER:
                raise GPT2PortError(f"{path}: truncated or corrupt safetensors header "
                                    f"(header claims {n} bytes, file has {size - 8} after the length)")
            raw = f.read(n)
    except IsADirectoryError:
        raise GPT2PortError(f"{path}: is a directory, expected a safetensors file") from None
    except FileNotFoundError:
        raise GPT2PortError(f"{path}: file not found") from None
    except PermissionError:
        raise GPT2PortError(f"{path}: permission denied") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise GPT2PortError(f"{path}: safetensors header is not valid JSON (corrupt or not a safetensors file)") from None
    if not isinstance(header, dict):
        raise GPT2PortError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise GPT2PortError(f"{path}: safetensors __metadata__ must map strings to strings")
    data_start = 8 + n
    entries = []
    for name, info in header.items():
        entries.append(_entry(path, name, info, data_start))
    entries.sort(key=lambda e: e.offset)
    expected = data_start
    for e in entries:
        if e.offset != expected:
            kind = "overlaps the previous tensor" if e.offset < expected else "leaves a gap before it"
            raise GPT2PortError(f"{path}: tensor {e.name!r} {kind} (bad data_offsets)")
        expected = e.offset + e.nbytes
    if expected != size:
        if expected > size:
            raise GPT2PortError(f"{path}: truncated: the header describes {expected} bytes, the file has {size}")
        raise GPT2PortError(f"{path}: {size - expected} unexplained bytes after the last tensor")
    return Header(path, {e.name: e for e in entries}, dict(metadata), data_start, size)


def _entry(path: Path, name: str, info, data_start: int) -> TensorEntry:
    if not isinstance(info, dict):
        raise GPT2PortError(f"{path}: header entry {name!r} is not an object")
    dtype = DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None  # a list is unhashable
    if dtype is None:
        raise GPT2PortError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise GPT2PortError(f"{path}: tensor {name!r} has an invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise GPT2PortError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise GPT2PortError(f"{path}: tensor {name!r}: shape {shape} x {info['dtype']} needs {nbytes} bytes, "
                            f"data_offsets give {offsets[1] - offsets[0]}")
    return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], nbytes)


def read_tensor(f, entry: TensorEntry, into: torch.Tensor | None = None) -> torch.Tensor:
    """Read one tensor with a positioned read (no mmap: the source's pages stay out of our RSS).

    into: a reusable uint8 buffer of at least entry.nbytes; the result is then a view of it, valid until the next
    read into the same buffer. Reusing one buffer saves the page faults of a fresh allocation per tensor.
    """
    raw = torch.empty(entry.nbytes, dtype=torch.uint8) if into is None else into[: entry.nbytes]
    got = os.preadv(f.fileno(), [raw.numpy()], entry.offset) if entry.nbytes else 0
    if got != entry.nbytes:
        raise GPT2PortError(f"{f.name}: short read of tensor {entry.name!r}")
    return raw.view(entry.dtype).reshape(entry.shape)


def encode_header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> tuple[bytes, list[int]]:
    """The length-prefixed JSON header for tensors laid out back to back in `entries` order.

    Returns the header bytes (padded with spaces to a multiple of 8, as the reference writer does) and each
    tensor's byte size.
    """
    header, offset, sizes = {"__metadata__": dict(metadata)}, 0, []
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        sizes.append(nbytes)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw, sizes


def mmap_tensors(header: Header) -> dict[str, torch.Tensor]:
    """Every tensor of the file as a view of one private, copy-on-write memory map: no read, no copy until used."""
    storage = torch.UntypedStorage.from_file(str(header.path), shared=False, nbytes=header.file_size)
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    out = {}
    for name, e in header.entries.items():
        raw = whole[e.offset : e.offset + e.nbytes]
        if e.offset % e.dtype.itemsize == 0:
            out[name] = raw.view(e.dtype).reshape(e.shape)
        else:  # misaligned for its dtype (mixed-dtype files): one copy of this tensor only
            out[name] = raw.clone().view(e.dtype).reshape(e.shape)
    return out
