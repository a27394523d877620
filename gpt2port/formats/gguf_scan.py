"""A GGUF file's header read with every count and length bounded by the bytes left in the file: its metadata
key/values and its tensor infos, as bytes and numbers (what they mean is formats/gguf.py's and its callers').

A count is never believed before the rest of the file could hold it (a header claiming an array of 2**62 items is
refused at once; llama.cpp's `gguf` package would loop over it), fixed-size runs are skipped in one step, and an
array's items are decoded only when its key is asked for, so the work and memory of opening a file are bounded by
its size. It imports nothing heavy, and takes a fraction of the time of the `gguf` package's reader, which slices
a numpy memmap once per value (a GPT-2 tokenizer is 100k strings).

Layout (GGUF v2/v3, little-endian): magic "GGUF", version u32, tensor count u64, metadata count u64; each metadata
entry a key (string: u64 length + bytes), a value type u32 and the value (an array: item type u32, count u64, items);
then each tensor's info: name (string), n_dims u32, dims u64 each (innermost first), GGML type u32, offset u64 (from
the start of the data, which begins at the first multiple of general.alignment after the infos).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from gpt2port.errors import GPT2PortError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what llama.cpp reads
STRING, ARRAY = 8, 9
UINT32 = 4
# value type -> struct code, for the fixed-size ones: u8 i8 u16 i16 u32 i32 f32 bool u64 i64 f64
CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
FIXED = {kind: struct.calcsize("<" + code) for kind, code in CODES.items()}
MAX_NESTING = 4  # arrays of arrays: no GGUF writer nests deeper than 2
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
_MIN_ITEM = 12  # the smallest array or tensor-info record: a length or count and a type
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class Field:
    """One metadata value: its type (an array's also its items' type and count); where its bytes start."""

    kind: int
    at: int  # the value's first byte (an array's: its first item's)
    item: int | None = None
    count: int = 1


@dataclass(frozen=True)
class TensorEntry:
    name: str
    ggml_type: int
    dims: tuple[int, ...]  # innermost first, as stored
    offset: int  # where its bytes start in the file


@dataclass
class Header:
    fields: dict[str, Field]
    tensors: list[TensorEntry]
    data_offset: int  # where the tensor data begins
    alignment: int  # of every tensor's offset
    size: int  # the buffer's byte count


def _refused(path: Path, detail: str) -> GPT2PortError:
    return GPT2PortError(f"{path}: not a readable GGUF file ({detail})")


class _Cursor:
    def __init__(self, data, path: Path):
        self.data, self.pos, self.path, self.size = data, 0, path, len(data)

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise _refused(self.path, f"truncated or corrupt: {what} at byte {self.pos} claims {n:,} bytes, only "
                                      f"{self.size - self.pos:,} are left in the file")

    def fixed(self, kind: int, what: str):
        self.need(FIXED[kind], what)
        (v,) = struct.unpack_from("<" + CODES[kind], self.data, self.pos)
        self.pos += FIXED[kind]
        return v

    def u32(self, what: str) -> int:
        return self.fixed(UINT32, what)

    def u64(self, what: str) -> int:
        return self.fixed(10, what)

    def count(self, what: str, each: int) -> int:
        """A count of records of at least `each` bytes, refused unless that many fit in what is left."""
        n = self.u64(what)
        self.need(n * each, f"{what} of {n:,}")
        return n

    def string(self, what: str) -> bytes:
        n = self.u64(what)
        self.need(n, what)
        self.pos += n
        return bytes(self.data[self.pos - n : self.pos])

    def text(self, what: str) -> str:
        raw = self.string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _refused(self.path, f"{what} is not UTF-8") from None

    def skip(self, kind: int, what: str, depth: int = 0) -> None:
        """Past one value of type `kind`."""
        if kind in FIXED:
            self.need(FIXED[kind], what)
            self.pos += FIXED[kind]
        elif kind == STRING:
            n = self.u64(what)
            self.need(n, what)
            self.pos += n
        elif kind == ARRAY:
            self.skip_items(*self.array_header(what, depth), what, depth)
        else:
            raise _refused(self.path, f"{what}: unknown metadata value type {kind}")

    def array_header(self, what: str, depth: int) -> tuple[int, int]:
        if depth >= MAX_NESTING:
            raise _refused(self.path, f"{what}: arrays nested more than {MAX_NESTING} deep")
        item = self.u32(what)
        if item in FIXED:
            n = self.u64(what)
            self.need(n * FIXED[item], f"{what}: an array of {n:,} {FIXED[item]}-byte items")
        elif item in (STRING, ARRAY):
            n = self.count(f"{what}: an array", 8 if item == STRING else _MIN_ITEM)
        else:
            raise _refused(self.path, f"{what}: unknown array item type {item}")
        return item, n

    def skip_items(self, item: int, n: int, what: str, depth: int) -> None:
        if item in FIXED:  # a run of fixed-size items: skipped in one step
            self.pos += n * FIXED[item]
        elif item == STRING:  # the tokenizer's 100k strings: one tight loop (the same checks as skip's)
            pos, size, length = self.pos, self.size, _U64.unpack_from
            for _ in range(n):
                if pos + 8 > size or pos + 8 + length(self.data, pos)[0] > size:
                    self.pos = pos
                    self.skip(STRING, what)  # refuses, naming the length
                pos += 8 + length(self.data, pos)[0]
            self.pos = pos
        else:
            for _ in range(n):
                self.skip(item, what, depth + 1)


def read_header(path: Path, data) -> Header:
    """The header of the GGUF whose whole bytes are `data` (a buffer: a memory map reads only what is walked), or a
    one-line refusal naming `path` where its counts and lengths, keys or names are not what a GGUF holds."""
    c = _Cursor(data, path)
    c.need(4, "the magic number")
    if bytes(data[:4]) != MAGIC:
        raise _refused(path, "no GGUF magic number")
    c.pos = 4
    version = c.u32("the version")
    if version & 0xFFFF == 0:
        raise _refused(path, "big-endian; only little-endian files are read")
    if version not in VERSIONS:
        raise _refused(path, f"version {version}; versions {', '.join(map(str, VERSIONS))} are read")
    n_tensors = c.u64("the tensor count")
    n_kv = c.count("the metadata count", _MIN_ITEM)
    fields: dict[str, Field] = {}
    for i in range(n_kv):
        key = c.text(f"metadata entry {i}'s key")
        what = f"metadata {key[:80]!r}"
        if key in fields:
            raise _refused(path, f"{what} appears twice")
        kind = c.u32(what)
        if kind == ARRAY:
            item, n = c.array_header(what, 0)
            fields[key] = Field(kind, c.pos, item, n)
            c.skip_items(item, n, what, 0)
        else:
            fields[key] = Field(kind, c.pos)
            c.skip(kind, what)
    c.need(n_tensors * (8 + 4 + 4 + 8), f"the tensor infos of {n_tensors:,} tensors")
    infos, names = [], set()
    for i in range(n_tensors):
        name = c.text(f"tensor info {i}'s name")
        if name in names:
            raise _refused(path, f"tensor {name[:80]!r} appears twice")
        names.add(name)
        n_dims = c.u32(f"tensor info {i}'s rank")
        if n_dims > MAX_DIMS:
            raise _refused(path, f"tensor info {i} claims {n_dims} dimensions, GGUF allows {MAX_DIMS}")
        c.need(8 * n_dims + 4 + 8, f"tensor info {i}")
        dims = struct.unpack_from(f"<{n_dims}Q", data, c.pos)
        c.pos += 8 * n_dims
        infos.append((name, c.u32(f"tensor info {i}"), dims, c.u64(f"tensor info {i}")))
    alignment = DEFAULT_ALIGNMENT
    if ALIGNMENT_KEY in fields:
        alignment = value(data, fields[ALIGNMENT_KEY]) if fields[ALIGNMENT_KEY].kind == UINT32 else 0
        if alignment <= 0 or alignment & (alignment - 1):
            raise _refused(path, f"metadata {ALIGNMENT_KEY!r} is not a power of two")
    start = c.pos + -c.pos % alignment
    tensors = [TensorEntry(name, kind, dims, start + offset) for name, kind, dims, offset in infos]
    return Header(fields, tensors, start, alignment, c.size)


def value(data, field: Field):
    """A field's value: a number or bool, bytes for a string, a list of those for an array (lists for arrays of
    arrays). `data` is the buffer read_header walked, which checked every length on the way."""
    if field.item is None:
        return _one(data, field.kind, field.at)[0]
    if field.item in FIXED:
        return list(struct.unpack_from(f"<{field.count}{CODES[field.item]}", data, field.at))
    out, pos = [], field.at
    if field.item == STRING:
        length = _U64.unpack_from
        for _ in range(field.count):
            n = length(data, pos)[0]
            out.append(data[pos + 8 : pos + 8 + n])
            pos += 8 + n
        return out
    for _ in range(field.count):
        v, pos = _one(data, field.item, pos)
        out.append(v)
    return out


def _one(data, kind: int, pos: int):
    """The value of type `kind` at `pos`, and where the next begins."""
    if kind in FIXED:
        return struct.unpack_from("<" + CODES[kind], data, pos)[0], pos + FIXED[kind]
    if kind == STRING:
        (n,) = struct.unpack_from("<Q", data, pos)
        return bytes(data[pos + 8 : pos + 8 + n]), pos + 8 + n
    item, n = struct.unpack_from("<IQ", data, pos)  # an array in an array
    end = _Cursor(data, Path())
    end.pos = pos + 12
    end.skip_items(item, n, "", 1)
    return value(data, Field(ARRAY, pos + 12, item, n)), end.pos
