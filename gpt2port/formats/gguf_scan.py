"""A GGUF file's structure walked with every count and length bounded by the bytes left in the file, before the
`gguf` package parses it.

The package believes the counts it reads: an array header claiming 2**62 items makes it loop 2**62 times (reads past
the end of its memory map give empty arrays, so nothing stops it), its memory growing without bound. This walk reads
only lengths, skips fixed-size runs in one step, and refuses any count or length the rest of the file cannot hold, so
its work and memory are bounded by the file's size. It imports nothing heavy.

Layout (GGUF v2/v3, little-endian): magic "GGUF", version u32, tensor count u64, metadata count u64; each metadata
entry a key (string: u64 length + bytes), a value type u32 and the value (an array: item type u32, count u64, items);
then each tensor's info: name (string), n_dims u32, dims u64 each, type u32, data offset u64.
"""

from __future__ import annotations

import struct
from pathlib import Path

from gpt2port.errors import GPT2PortError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what the gguf package reads
STRING, ARRAY = 8, 9
# value type -> bytes, for the fixed-size ones: u8 i8 u16 i16 u32 i32 f32 bool u64 i64 f64
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
MAX_NESTING = 4  # arrays of arrays: no GGUF writer nests deeper than 2
MAX_DIMS = 4  # GGML_MAX_DIMS
_MIN_ITEM = 12  # the smallest array or tensor-info record: a length or count and a type


def _refused(path: Path, detail: str) -> GPT2PortError:
    return GPT2PortError(f"{path}: not a readable GGUF file ({detail})")


class _Cursor:
    def __init__(self, data, path: Path):
        self.data, self.pos, self.path, self.size = data, 0, path, len(data)

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise _refused(self.path, f"truncated or corrupt: {what} at byte {self.pos} claims {n:,} bytes, only "
                                      f"{self.size - self.pos:,} are left in the file")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = struct.unpack_from("<I", self.data, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = struct.unpack_from("<Q", self.data, self.pos)
        self.pos += 8
        return v

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

    def skip_string(self, what: str) -> None:
        n = self.u64(what)
        self.need(n, what)
        self.pos += n

    def value(self, kind: int, what: str, depth: int = 0) -> None:
        if kind in FIXED:
            self.need(FIXED[kind], what)
            self.pos += FIXED[kind]
        elif kind == STRING:
            self.skip_string(what)
        elif kind == ARRAY:
            if depth >= MAX_NESTING:
                raise _refused(self.path, f"{what}: arrays nested more than {MAX_NESTING} deep")
            item = self.u32(what)
            if item in FIXED:  # a run of fixed-size items: skipped in one step
                n = self.u64(what)
                self.need(n * FIXED[item], f"{what}: an array of {n:,} {FIXED[item]}-byte items")
                self.pos += n * FIXED[item]
            elif item in (STRING, ARRAY):
                n = self.count(f"{what}: an array", 8 if item == STRING else _MIN_ITEM)
                for _ in range(n):
                    self.value(item, what, depth + 1)
            else:
                raise _refused(self.path, f"{what}: unknown array item type {item}")
        else:
            raise _refused(self.path, f"{what}: unknown metadata value type {kind}")


def check_structure(path: Path, data) -> None:
    """Refuse, in one line naming `path`, a GGUF whose counts and lengths its own bytes (`data`, the whole file as a
    buffer) cannot hold; what is left is safe to hand to the gguf package."""
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
    for i in range(n_kv):
        key = c.string(f"metadata entry {i}'s key")
        what = f"metadata {key.decode('utf-8', 'replace')[:80]!r}"
        c.value(c.u32(what), what)
    c.need(n_tensors * (8 + 4 + 4 + 8), f"the tensor infos of {n_tensors:,} tensors")
    for i in range(n_tensors):
        c.skip_string(f"tensor info {i}'s name")
        n_dims = c.u32(f"tensor info {i}'s rank")
        if n_dims > MAX_DIMS:
            raise _refused(path, f"tensor info {i} claims {n_dims} dimensions, GGUF allows {MAX_DIMS}")
        c.need(8 * n_dims + 4 + 8, f"tensor info {i}")
        c.pos += 8 * n_dims + 4 + 8
