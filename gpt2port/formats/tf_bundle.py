"""TensorFlow checkpoints (the tensor-bundle format OpenAI released GPT-2 in), read without TensorFlow.

A checkpoint `PREFIX` is `PREFIX.index`, a sorted string table (SSTable), and data shards
`PREFIX.data-0000i-of-0000n` holding each tensor's raw bytes. The table maps every variable name to a
BundleEntryProto (dtype, shape, shard, offset, size, crc32c); the empty key holds a BundleHeaderProto (shard
count, endianness). Every table block and every tensor carries a masked crc32c, and both are checked: a flipped
byte is refused naming the block or the tensor, before anything is written.

The table: blocks of prefix-compressed key/value entries (shared length, unshared length, value length as
varints; a restart array at the block's end), each followed by a 5-byte trailer (compression type, masked
crc32c of the block and that type byte); an index block whose values are the data blocks' handles (offset, size
as varints); and a 48-byte footer: the metaindex and index handles, padding, and the table magic number.

TensorFlow's own files only: the bundle, and the `checkpoint` state file that every TensorFlow saver writes beside
it to name the latest prefix. What the tensors and OpenAI's hparams.json mean for GPT-2 is readers/openai_tf.py's.
"""

from __future__ import annotations

import ctypes
import re
import struct
from pathlib import Path

import torch

from gpt2port import hashing, inputs
from gpt2port.errors import GPT2PortError
from gpt2port.formats.base import FLOAT_DTYPES, Reader, TensorInfo, TensorStream, read_whole, refuse_lfs_pointer

TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER = 48
TRAILER = 5
STATE_FILE = "checkpoint"  # the text proto TensorFlow's savers write beside their checkpoints: the latest prefix
CHUNK = 1 << 20  # bytes per checksum piece: small enough to stay in cache, large enough to be cheap
# TensorFlow's DataType enum -> torch dtype, for the types a reader can hand out (the rest are named in refusals).
DTYPES = {1: torch.float32, 2: torch.float64, 3: torch.int32, 9: torch.int64, 14: torch.bfloat16, 19: torch.float16}
DTYPE_NAMES = {1: "float32", 2: "float64", 3: "int32", 4: "uint8", 5: "int16", 6: "int8", 7: "string",
               8: "complex64", 9: "int64", 10: "bool", 14: "bfloat16", 19: "float16"}


def _crc32c(pieces, crc: int = 0) -> int:
    import google_crc32c  # the C implementation: a CRC in Python over gigabytes would take far longer than the read

    for piece in pieces:  # bytes, or buffers it need not release (see _CheckedStream)
        crc = google_crc32c.extend(crc, piece)
    return crc


def masked_crc32c(data: bytes | list) -> int:
    """The checksum TensorFlow stores: crc32c rotated right by 15 bits plus a constant (so that a crc of data
    holding crcs is not itself trivially related to them). data: bytes, or an iterable of bytes pieces."""
    return _mask(_crc32c([data] if isinstance(data, bytes) else data))


def _mask(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# --- protocol buffers, the few wire types these messages use -------------------------------------------------

def _varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf) -> list[tuple[int, int | bytes]]:
    """(field number, value) for each field of a message: ints for varints and fixed, bytes for length-delimited."""
    out, pos = [], 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = struct.unpack_from("<Q", buf, pos)[0], pos + 8
        elif wire == 5:
            value, pos = struct.unpack_from("<I", buf, pos)[0], pos + 4
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = bytes(buf[pos : pos + n]), pos + n
            if pos > len(buf):
                raise ValueError("truncated field")
        else:
            raise ValueError(f"unsupported wire type {wire}")
        out.append((number, value))
    return out


def _shape(buf) -> tuple[int, ...]:
    if not isinstance(buf, bytes):
        raise ValueError("the shape is not a message")
    dims = []
    for number, value in _fields(buf):
        if number == 2:  # repeated Dim {int64 size = 1; string name = 2}
            if not isinstance(value, bytes):
                raise ValueError("a dimension that is not a message")
            size = next((v for n, v in _fields(value) if n == 1), 0)
            if not isinstance(size, int) or size >= 1 << 63:  # bytes, or a negative int64 (-1: unknown)
                raise ValueError(f"dimension {len(dims)} is not a size")
            dims.append(size)
        elif number == 3 and value:
            raise ValueError("a shape of unknown rank")
    return tuple(dims)


def _ints(fields: list[tuple[int, int | bytes]], numbers: tuple[int, ...], what: str) -> dict[int, int]:
    """Fields `numbers` of a message, each an integer (a varint or fixed field) where present."""
    out = {}
    for n, v in fields:
        if n in numbers:
            if not isinstance(v, int):
                raise ValueError(f"{what} field {n} is not an integer")
            out[n] = v
    return out


# --- the sorted string table -----------------------------------------------------------------------------------

def _handle(buf, pos: int = 0) -> tuple[int, int, int]:
    offset, pos = _varint(buf, pos)
    size, pos = _varint(buf, pos)
    return offset, size, pos


def _block(data: bytes, offset: int, size: int, where: str) -> bytes:
    if offset + size + TRAILER > len(data):
        raise GPT2PortError(f"{where}: a table block runs past the end of the file (truncated?)")
    contents = data[offset : offset + size]
    kind, crc = data[offset + size], struct.unpack_from("<I", data, offset + size + 1)[0]
    if masked_crc32c(data[offset : offset + size + 1]) != crc:
        raise GPT2PortError(f"{where}: table block at byte {offset} fails its crc32c check (the file is damaged)")
    if kind != 0:
        raise GPT2PortError(f"{where}: table block at byte {offset} is compressed (type {kind}); only "
                            f"uncompressed index files are read")
    return contents


def _entries(block: bytes):
    (restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    end = len(block) - 4 * (restarts + 1)
    pos, key = 0, b""
    while pos < end:
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        length, pos = _varint(block, pos)
        key = key[:shared] + block[pos : pos + unshared]
        pos += unshared
        yield key, block[pos : pos + length]
        pos += length


def read_table(path: Path) -> dict[bytes, bytes]:
    """Every key and value of an SSTable file, checked block by block."""
    data = inputs.read_bytes(path, inputs.LIMITS["json"], "a TensorFlow checkpoint index")
    refuse_lfs_pointer(path, data[:64])
    if len(data) < FOOTER or struct.unpack_from("<Q", data, len(data) - 8)[0] != TABLE_MAGIC:
        raise GPT2PortError(f"{path}: not a TensorFlow checkpoint index (no table magic number at its end)")
    try:
        footer = data[len(data) - FOOTER :]
        _, _, pos = _handle(footer)
        offset, size, _ = _handle(footer, pos)
        table = {}
        for _, value in _entries(_block(data, offset, size, str(path))):
            block_offset, block_size, _ = _handle(value)
            table.update(_entries(_block(data, block_offset, block_size, str(path))))
        return table
    except (ValueError, struct.error, IndexError) as e:
        raise GPT2PortError(f"{path}: damaged checkpoint index ({e})") from None


# --- the bundle ------------------------------------------------------------------------------------------------

def prefix_of(path: Path) -> Path:
    """The checkpoint prefix from what a user points at: PREFIX.index, PREFIX, or a data shard."""
    name = path.name
    if name.endswith(".index"):
        return path.with_name(name[: -len(".index")])
    if ".data-" in name:
        return path.with_name(name[: name.index(".data-")])
    return path


def checkpoint_in(directory: Path) -> Path | None:
    """The .index of the checkpoint a TensorFlow model directory holds: the one its `checkpoint` file names
    (model_checkpoint_path), or its only *.index."""
    state = directory / STATE_FILE
    if state.is_file():
        text = inputs.read_bytes(state, inputs.LIMITS["json"], "a TensorFlow checkpoint file").decode(errors="replace")
        m = re.search(r'^model_checkpoint_path:\s*"([^"]+)"', text, re.M)
        if m:
            prefix = Path(m.group(1))
            return (prefix if prefix.is_absolute() else directory / prefix).with_name(prefix.name + ".index")
    found = sorted(directory.glob("*.index"))
    return found[0] if len(found) == 1 else None


def index_for(path: Path) -> Path | None:
    """The .index a user means by a path that is not a weights file itself: the `checkpoint` state file, a data
    shard, or the bare prefix (models/124M/model.ckpt)."""
    if path.name == STATE_FILE and path.is_file():
        return checkpoint_in(path.parent)
    if ".data-" in path.name or not path.exists():
        index = prefix_of(path).with_name(prefix_of(path).name + ".index")
        return index if index.is_file() else None
    return None


class TFBundleReader(Reader):
    """A tensor bundle's variables by their TensorFlow names, each read checked against its crc32c."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        prefix = prefix_of(self.path)
        self.index_file = prefix.with_name(prefix.name + ".index")
        if not self.index_file.is_file():
            raise GPT2PortError(f"{self.index_file}: no such file (a TensorFlow checkpoint needs its .index)")
        table = read_table(self.index_file)
        where = str(self.index_file)
        try:  # BundleHeaderProto {int32 num_shards = 1; Endianness endianness = 2; ...}
            header = _ints(_fields(table.pop(b"", b"")), (1, 2), "header")
        except (ValueError, struct.error) as e:
            raise GPT2PortError(f"{where}: damaged checkpoint header ({e})") from None
        shards = header.get(1, 1)
        if header.get(2, 0) != 0:
            raise GPT2PortError(f"{where}: written big-endian; only little-endian checkpoints are read")
        if not 1 <= shards <= 99999:  # the 5-digit file names; 0 shards cannot hold a tensor
            raise GPT2PortError(f"{where}: the header claims {shards} data shards")
        self.files = []
        for i in range(shards):  # looked for one by one: a count the disk does not bear out stops at the first gap
            f = prefix.with_name(f"{prefix.name}.data-{i:05d}-of-{shards:05d}")
            if not f.is_file():
                raise GPT2PortError(f"{f}: missing data shard ({shards} shard(s) listed in {self.index_file.name})")
            self.files.append(f)
        sizes = [f.stat().st_size for f in self.files]
        self.tensors, self._crc = {}, {}
        for key, value in table.items():
            name = key.decode("utf-8", "replace")
            try:  # BundleEntryProto {dtype = 1; shape = 2; shard_id = 3; offset = 4; size = 5; crc32c = 6; slices = 7}
                fields = _fields(value)
                entry = _ints(fields, (1, 3, 4, 5, 6), f"entry {name!r}:")
                shape = _shape(next((v for n, v in fields if n == 2), b""))
            except (ValueError, struct.error) as e:
                raise GPT2PortError(f"{where}: entry {name!r} is damaged ({e})") from None
            if any(n == 7 for n, _ in fields):
                raise GPT2PortError(f"{where}: {name!r} is stored in slices (a partitioned variable); not supported")
            dtype = DTYPES.get(entry.get(1, 0))
            if dtype not in FLOAT_DTYPES:
                kind = DTYPE_NAMES.get(entry.get(1, 0), f"type {entry.get(1)}")
                raise GPT2PortError(f"{where}: {name!r} is {kind}; GPT-2's variables are all floating point")
            shard, offset, size = entry.get(3, 0), entry.get(4, 0), entry.get(5, 0)
            expected = dtype.itemsize * _numel(shape)
            if shard < shards and size == expected and offset + size > sizes[shard]:
                raise GPT2PortError(f"{self.files[shard]}: truncated (tensor {name!r} ends at byte {offset + size}; "
                                    f"the file has {sizes[shard]})")
            if shard >= shards or size != expected:
                raise GPT2PortError(f"{where}: {name!r} ({size} bytes at {offset} in shard {shard}) does not fit "
                                    f"{self.files[min(shard, shards - 1)].name} or its shape {list(shape)}")
            self.tensors[name] = TensorInfo(name, dtype, shape, self.files[shard], offset, size)
            self._crc[name] = entry.get(6)
        self.metadata = {}
        self._loans = hashing.Loans()  # pieces of the caller's `into` buffer lent to the source's hash

    def read(self, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        """One tensor, checked against its crc32c, a CHUNK at a time (each piece checked while in cache). Into
        `into` when given (no fresh memory per tensor: at 1.5B parameters, faulting in a new buffer for every tensor
        costs more than the checksum); see formats.base.read_whole."""
        return read_whole(self.stream(name), into, self._loans, CHUNK)

    def stream(self, name: str) -> TensorStream:
        return _CheckedStream(self.tensors[name], self._crc[name], self.hashes)


class _CheckedStream(TensorStream):
    """A tensor read piece by piece, its crc32c carried across the pieces and compared at finish()."""

    def __init__(self, info: TensorInfo, crc: int | None, hashes: hashing.Hashes | None):
        super().__init__(info, hashes)
        self._expected, self._crc = crc, 0

    def piece(self, view: memoryview) -> None:
        # The checksum library takes only buffers it need not release: a ctypes view of the bytes is one (no copy).
        piece = (ctypes.c_char * len(view)).from_buffer(view)
        self._crc = _crc32c([piece], self._crc)
        del piece

    def finish(self) -> None:
        super().finish()
        if self._expected is not None and _mask(self._crc) != self._expected:
            raise GPT2PortError(f"{self.info.file}: tensor {self.info.name!r} fails its crc32c check (the file is "
                                f"damaged)")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
