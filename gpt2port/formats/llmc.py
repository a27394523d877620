"""llm.c's binary files (karpathy/llm.c): a model file, a tokenizer file and a debug-state file.

Each begins with 256 little-endian int32s: a magic number, a version, then the file's sizes (the rest zeros).

    model        20240326, version 3 (fp32) or 5 (bf16); max_seq_len, vocab_size, num_layers, num_heads, channels,
                 padded_vocab_size. Then every parameter back to back, in the order and shapes of layouts.llmc.
    debug state  20240327, version 2; B, T. Then x and y (B*T int32 each), the logits (B*T*vocab_size fp32, not
                 padded), the loss (one fp32), and every parameter's gradient as fp32 in the model file's layout.
    tokenizer    20240328, version 2; the number of tokens, the end-of-text id. Then per token one length byte
                 and that many bytes.

The files carry no names and no checksum, so what can be checked is: magic and version (here), sizes that make a
GPT-2 (readers/llmc.py, which names and shapes the tensors by layouts/llmc.py), and that the header accounts for the
file's length to the byte (check_size).
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import torch

from gpt2port import inputs
from gpt2port.errors import GPT2PortError
from gpt2port.formats.base import Reader, TensorInfo, refuse_lfs_pointer
from gpt2port.fsio import os_reason
from gpt2port.outfile import open_append

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MODEL_MAGIC, STATE_MAGIC, TOKENIZER_MAGIC = 20240326, 20240327, 20240328
MODEL_VERSIONS = {3: torch.float32, 5: torch.bfloat16}
STATE_VERSION = 2
TOKENIZER_VERSION = 2
_KIND = {MODEL_MAGIC: "model", STATE_MAGIC: "debug-state", TOKENIZER_MAGIC: "tokenizer"}
TOKENIZER_FILE = "gpt2_tokenizer.bin"  # the name llm.c gives its tokenizer file, beside the model file


def header(magic: int, version: int, *fields: int) -> bytes:
    ints = [magic, version, *fields]
    return struct.pack(f"<{HEADER_INTS}i", *ints, *[0] * (HEADER_INTS - len(ints)))


def magic_of(path: Path) -> int | None:
    """The llm.c magic number a file starts with, or None."""
    with inputs.open_binary(path) as f:
        head = f.read(4)
    found = struct.unpack("<i", head)[0] if len(head) == 4 else None
    return found if found in _KIND else None


def read_header(path: Path, magic: int, versions) -> tuple[list[int], int]:
    """The header's ints after checking magic and version; and the file's size."""
    try:
        with inputs.open_binary(path) as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise GPT2PortError(f"{path}: cannot read: {os_reason(e)}") from None
    refuse_lfs_pointer(path, raw)
    if len(raw) < HEADER_BYTES:
        raise GPT2PortError(f"{path}: truncated llm.c {_KIND[magic]} file ({size} bytes, the header alone is "
                            f"{HEADER_BYTES})")
    ints = list(struct.unpack(f"<{HEADER_INTS}i", raw))
    if ints[0] != magic:
        what = f"llm.c's {_KIND[ints[0]]} file" if ints[0] in _KIND else f"magic {ints[0]}"
        raise GPT2PortError(f"{path}: not an llm.c {_KIND[magic]} file ({what}; expected magic {magic})")
    if ints[1] not in versions:
        raise GPT2PortError(f"{path}: llm.c {_KIND[magic]} file version {ints[1]} is not supported "
                            f"(supported: {', '.join(map(str, versions))})")
    return ints, size


def check_size(path: Path, expected: int, size: int, what: str) -> None:
    if size < expected:
        raise GPT2PortError(f"{path}: truncated: {what} needs {expected} bytes, the file has {size}")
    if size > expected:
        raise GPT2PortError(f"{path}: {size - expected} unexplained bytes after {what} (header disagrees with the "
                            f"file's size)")


def place(path: Path, shapes, dtype: torch.dtype) -> tuple[dict[str, TensorInfo], int]:
    """TensorInfos for `shapes` [(name, shape)], stored back to back after the header in `dtype`; and the byte at
    which the last ends."""
    offset, tensors = HEADER_BYTES, {}
    for key, shape in shapes:
        nbytes = math.prod(shape) * dtype.itemsize
        tensors[key] = TensorInfo(key, dtype, shape, path, offset, nbytes)
        offset += nbytes
    return tensors, offset


def write_raw(path: Path, head: bytes, items, progress=None) -> int:
    """Write `head`, then `items` [(key, dtype, shape, produce)] back to back, each produce() called only when its
    turn comes (one tensor in memory). fsynced; returns the bytes written. The caller writes inside a staged
    directory, so a failure leaves nothing behind."""
    total = sum(math.prod(shape) * dtype.itemsize for _, dtype, shape, _ in items)
    done = 0
    try:
        f = open_append(path)
    except OSError as e:
        raise GPT2PortError(f"{path}: cannot create: {os_reason(e)}") from None
    try:
        f.write(head)
        for key, dtype, shape, produce in items:
            t = produce().detach().cpu()
            if tuple(t.shape) != tuple(shape):
                raise GPT2PortError(f"{path}: internal error: {key} has shape {tuple(t.shape)}, declared {shape}")
            # Raw bytes whatever the dtype (numpy has no bfloat16): reinterpret as uint8 without a copy.
            f.write(memoryview(t.to(dtype).contiguous().reshape(-1).view(torch.uint8).numpy()))
            done += math.prod(shape) * dtype.itemsize
            if progress:
                progress(done, total)
        f.close()
    except OSError as e:
        f.abort()
        raise GPT2PortError(f"{path}: write failed: {os_reason(e)}") from None
    except BaseException:
        f.abort()
        raise
    return len(head) + total


# --- the tokenizer file ----------------------------------------------------------------------------------------

def tokenizer_bytes(tokens: list[bytes], eot: int) -> bytes:
    out = [header(TOKENIZER_MAGIC, TOKENIZER_VERSION, len(tokens), eot)]
    for t in tokens:
        if not 0 < len(t) < 256:  # llm.c stores the length in one byte
            raise GPT2PortError(f"token of {len(t)} bytes cannot be stored in llm.c's tokenizer file")
        out.append(bytes([len(t)]) + t)
    return b"".join(out)


def read_tokenizer(path: Path) -> tuple[list[bytes], int]:
    """(every token's bytes, in id order; the end-of-text id)."""
    ints, size = read_header(path, TOKENIZER_MAGIC, (TOKENIZER_VERSION,))
    n, eot = ints[2], ints[3]
    data = inputs.read_bytes(path, inputs.LIMITS["tokenizer"], "an llm.c tokenizer file")[HEADER_BYTES:]
    tokens, at = [], 0
    for _ in range(max(n, 0)):
        if at >= len(data) or at + 1 + data[at] > len(data):
            raise GPT2PortError(f"{path}: truncated: the header says {n} tokens, the file ends after {len(tokens)}")
        tokens.append(data[at + 1:at + 1 + data[at]])
        at += 1 + data[at]
    if at != len(data):
        raise GPT2PortError(f"{path}: {len(data) - at} unexplained bytes after the {n} tokens its header lists")
    if not 0 <= eot < n:
        raise GPT2PortError(f"{path}: end-of-text id {eot} is outside the {n} tokens")
    return tokens, eot


def state_header(batch: int, seq_len: int) -> bytes:
    return header(STATE_MAGIC, STATE_VERSION, batch, seq_len)


def open_bin(path: Path, pickle_reader, model_reader) -> Reader:
    """`.bin` is PyTorch's pickle suffix and llm.c's: llm.c's files start with their magic number, a pickle with a
    zip signature (PK) or a pickle opcode (0x80). model_reader opens an llm.c model file (the names and shapes of
    its tensors are the model's, not the format's)."""
    magic = magic_of(path)
    if magic == MODEL_MAGIC:
        return model_reader(path)
    if magic is not None:
        raise GPT2PortError(f"{path}: is llm.c's {_KIND[magic]} file, not a model file")
    with inputs.open_binary(path) as f:
        head = f.read(4)
    if head[:2] == b"PK" or head[:1] == b"\x80" or head.startswith(b"version"):
        return pickle_reader(path)
    found = struct.unpack("<i", head)[0] if len(head) == 4 else None
    raise GPT2PortError(f"{path}: neither a PyTorch pickle nor an llm.c model file (magic {found}, llm.c's is "
                        f"{MODEL_MAGIC})")
