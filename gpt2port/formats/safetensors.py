"""The safetensors format: a strict reader and a streaming writer.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON ({name: {dtype, shape,
data_offsets}}, plus optional string "__metadata__"), then the tensor bytes. gpt2port reads and writes this layout
itself so it can stream (pread one tensor at a time, never map a 6 GB source into its RSS; write each tensor as soon
as it is converted, header first) and so a damaged file is named precisely instead of failing deep inside a library.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2port import hashing, inputs, jsonio
from gpt2port.errors import GPT2PortError
from gpt2port.formats.base import Reader, TensorInfo, TensorStream, read_whole, refuse_lfs_pointer
from gpt2port.formats.prefetch import Prefetcher
from gpt2port.fsio import os_reason
from gpt2port.outfile import open_append

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's own limit
READ_PIECE = 16 << 20  # bytes per read: the source's hash takes each piece while the next is read


@dataclass(frozen=True)
class Header:
    path: Path
    entries: dict[str, TensorInfo]  # in file order; offset is absolute in the file
    metadata: dict[str, str]
    file_size: int


def read_header(path: Path) -> Header:
    """Parse and validate a safetensors header; raise a one-line error naming `path` on any inconsistency."""
    path = Path(path)
    try:
        with inputs.open_binary(path, what="a safetensors file") as f:
            size = os.fstat(f.fileno()).st_size
            refuse_lfs_pointer(path, f.read(64))
            f.seek(0)
            head = f.read(8)
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
        header = jsonio.loads(raw, path)
    except GPT2PortError as e:
        raise GPT2PortError(f"{path}: safetensors header: {str(e).removeprefix(f'{path}: ')} (corrupt or not a "
                            f"safetensors file)") from None
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
    return Header(path, {e.name: e for e in entries}, dict(metadata), size)


def _entry(path: Path, name: str, info, data_start: int) -> TensorInfo:
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
    return TensorInfo(name, dtype, tuple(shape), path, data_start + offsets[0], nbytes)


def encode_header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                  metadata: dict[str, str]) -> tuple[bytes, list[int]]:
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


class PreadReader(Reader):
    """A reader of one file whose tensors' offsets are known: each read is positioned reads (no mmap: the source's
    pages stay out of our RSS). Subclasses set path and tensors."""

    _loans = None  # pieces of the caller's `into` buffer lent to the source's hash

    def read(self, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        if self._loans is None:
            self._loans = hashing.Loans()
        return read_whole(self.stream(name), into, self._loans, READ_PIECE)

    def stream(self, name: str) -> TensorStream:
        return TensorStream(self.tensors[name], self.hashes)


class SafetensorsReader(PreadReader):
    """A safetensors file, checked whole at open; tensors read with pread, so the file is never mapped."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.header = read_header(self.path)
        self.files = [self.path]
        self.tensors = self.header.entries
        self.metadata = self.header.metadata


class StreamingSafetensorsWriter:
    """Writes tensors declared in advance, in that order, one at a time. Use as a context manager; `close()`
    fsyncs and re-checks the file against the declaration."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]):
        self.path = Path(path)
        self.entries = entries
        self.metadata = metadata
        header, _ = encode_header(entries, metadata)
        self._next = 0
        self._file = open_append(self.path)
        self._write(header)

    def write(self, name: str, chunks) -> None:
        """The next declared tensor, as consecutive chunks of its bytes (already in its dtype and row-major order:
        see prefetch.Prefetcher), or their count where the prefetcher poured them into `sink` itself."""
        expected_name, dtype, shape = self.entries[self._next]
        if name != expected_name:
            raise GPT2PortError(f"{self.path}: internal error: got {name}, declared {expected_name}")
        written, nbytes = 0, math.prod(shape) * dtype.itemsize
        try:
            for chunk in chunks:
                if isinstance(chunk, int):  # that many bytes poured into the file by the prefetcher itself
                    written += chunk
                else:
                    written += self._file.write(chunk)
        except OSError as e:
            raise GPT2PortError(f"{self.path}: write failed: {os_reason(e)}") from None
        if written != nbytes:
            raise GPT2PortError(f"{self.path}: internal error: {name} came as {written} bytes, declared {nbytes}")
        self._next += 1

    @property
    def sink(self):
        """The open output, for a Prefetcher to copy into directly where it lends its buffers."""
        return self._file

    def _write(self, data) -> None:
        try:
            self._file.write(data)
        except OSError as e:
            raise GPT2PortError(f"{self.path}: write failed: {os_reason(e)}") from None

    def close(self) -> None:
        if self._next != len(self.entries):
            raise GPT2PortError(f"{self.path}: internal error: {len(self.entries) - self._next} tensors never written")
        try:
            self._file.close()
        except OSError as e:
            raise GPT2PortError(f"{self.path}: write failed: {os_reason(e)}") from None
        check_written(self.path, self.entries, self.metadata)

    def abort(self) -> None:
        self._file.abort()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *rest):
        if exc_type is None:
            self.close()
        else:
            self.abort()


def stream_safetensors(path: Path, items, metadata: dict[str, str], progress=None) -> None:
    """Write `items` [(name, dtype, shape, produce)] to `path`, calling each produce() only when its turn comes (on
    a worker thread, one tensor ahead of the writes), so about one tensor is in memory. progress(done_bytes,
    total_bytes) after each tensor."""
    sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape, _ in items]
    done = 0
    with StreamingSafetensorsWriter(path, [(n, d, s) for n, d, s, _ in items], metadata) as writer:
        for (name, chunks), size in zip(Prefetcher(items, sink=writer.sink), sizes):
            writer.write(name, chunks)
            done += size
            if progress:
                progress(done, sum(sizes))


def check_written(path: Path, entries, metadata: dict[str, str]) -> None:
    """Re-open a file just written and confirm its header says exactly what was declared."""
    header = read_header(path)
    got = [(e.name, e.dtype, tuple(e.shape)) for e in header.entries.values()]
    if got != [(n, d, tuple(s)) for n, d, s in entries] or header.metadata != metadata:
        raise GPT2PortError(f"{path}: post-write check failed: the file on disk does not match what was written")


