"""llm.c's binary files (karpathy/llm.c): a model file, a tokenizer file and a debug-state file.

Each begins with 256 little-endian int32s: a magic number, a version, then the file's sizes (the rest zeros).

    model        20240326, version 3 (fp32) or 5 (bf16); max_seq_len, vocab_size, num_layers, num_heads, channels,
                 padded_vocab_size. Then every parameter back to back, in the order and shapes of layouts.llmc.
    debug state  20240327, version 2; B, T. Then x and y (B*T int32 each), the logits (B*T*vocab_size fp32, not
                 padded), the loss (one fp32), and every parameter's gradient as fp32 in the model file's layout.
    tokenizer    20240328, version 2; the number of tokens, the end-of-text id. Then per token one length byte
                 and that many bytes.

The files carry no names and no checksum, so the reader checks what it can: magic, version, sizes that make a
GPT-2, and that the header accounts for the file's length to the byte.
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import numpy as np
import torch

from gpt2port.config import GPTConfig
from gpt2port.errors import GPT2PortError
from gpt2port.formats.base import Reader, TensorInfo, refuse_lfs_pointer
from gpt2port.formats.safetensors import PreadReader
from gpt2port.fsio import os_reason
from gpt2port.outfile import open_append
from gpt2port.layouts.llmc import LLMC, VOCAB_MULTIPLE
from gpt2port.tokenizer import NO_TOKENIZER, vocab_and_merges

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MODEL_MAGIC, STATE_MAGIC, TOKENIZER_MAGIC = 20240326, 20240327, 20240328
MODEL_VERSIONS = {3: torch.float32, 5: torch.bfloat16}
STATE_VERSION = 2
TOKENIZER_VERSION = 2
_KIND = {MODEL_MAGIC: "model", STATE_MAGIC: "debug-state", TOKENIZER_MAGIC: "tokenizer"}
# llm.c names its model file by the parameter count of the four official sizes.
TOKENIZER_FILE = "gpt2_tokenizer.bin"
SIZE_NAMES = {(12, 768): "124M", (24, 1024): "355M", (36, 1280): "774M", (48, 1600): "1558M"}


def model_file_name(config: GPTConfig) -> str:
    return f"gpt2_{SIZE_NAMES.get((config.n_layer, config.n_embd), 'model')}.bin"


def state_file_name(config: GPTConfig) -> str:
    return model_file_name(config).removesuffix(".bin") + "_debug_state.bin"


def padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def header(magic: int, version: int, *fields: int) -> bytes:
    ints = [magic, version, *fields]
    return struct.pack(f"<{HEADER_INTS}i", *ints, *[0] * (HEADER_INTS - len(ints)))


def model_header(config: GPTConfig, dtype: torch.dtype) -> bytes:
    version = next((v for v, d in MODEL_VERSIONS.items() if d == dtype), None)
    if version is None:
        raise GPT2PortError(f"llm.c model files hold fp32 or bf16, not {dtype}; pass --dtype fp32 or bf16")
    return header(MODEL_MAGIC, version, config.n_positions, config.vocab_size, config.n_layer, config.n_head,
                  config.n_embd, padded_vocab(config.vocab_size))


def magic_of(path: Path) -> int | None:
    """The llm.c magic number a file starts with, or None."""
    with open(path, "rb") as f:
        head = f.read(4)
    found = struct.unpack("<i", head)[0] if len(head) == 4 else None
    return found if found in _KIND else None


def _read_header(path: Path, magic: int, versions) -> tuple[list[int], int]:
    """The header's ints after checking magic and version; and the file's size."""
    try:
        with open(path, "rb") as f:
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


class LlmcReader(PreadReader):
    """An llm.c model file: the config from its header, each tensor read with pread at its place."""

    layout = LLMC.name

    def __init__(self, path: Path):
        self.path = Path(path)
        self.files = [self.path]
        ints, size = _read_header(self.path, MODEL_MAGIC, MODEL_VERSIONS)
        dtype = MODEL_VERSIONS[ints[1]]
        max_t, vocab, n_layer, n_head, n_embd, padded = ints[2:8]
        if min(max_t, vocab, n_layer, n_head, n_embd) < 1 or n_embd % n_head:
            raise GPT2PortError(f"{self.path}: header sizes do not make a GPT-2 (max_seq_len {max_t}, vocab_size "
                                f"{vocab}, {n_layer} layers, {n_head} heads, {n_embd} channels)")
        if padded != padded_vocab(vocab):
            raise GPT2PortError(f"{self.path}: padded_vocab_size {padded} is not vocab_size {vocab} rounded up to a "
                                f"multiple of {VOCAB_MULTIPLE} ({padded_vocab(vocab)})")
        self.model_config = {"model_type": "gpt2", "n_layer": n_layer, "n_head": n_head, "n_embd": n_embd,
                             "vocab_size": vocab, "n_positions": max_t}
        # The blocks' matrices alone (12 C^2 per layer) bound the length from below: a header claiming huge sizes
        # fails here, on the file's length, before a single tensor is even listed.
        if n_layer * 12 * n_embd * n_embd * dtype.itemsize > size:
            raise GPT2PortError(f"{self.path}: truncated: a {n_layer}-layer, {n_embd}-wide model needs more than the "
                                f"file's {size} bytes")
        shapes = [(w.key, w.shape) for w in LLMC.order(LLMC.plan_write(_config(self.model_config, self.path)))]
        offset, self.tensors = HEADER_BYTES, {}
        for key, shape in shapes:
            nbytes = math.prod(shape) * dtype.itemsize
            self.tensors[key] = TensorInfo(key, dtype, shape, self.path, offset, nbytes)
            offset += nbytes
        check_size(self.path, offset, size, f"the {n_layer}-layer model its header describes")
        self.metadata = {}
        self.warnings: list[str] = []

    def inputs(self) -> list[Path]:
        return [*super().inputs(), self.path.parent / TOKENIZER_FILE]

    def _read_tokenizer(self) -> tuple | None:
        """GPT-2's tokens and merges from a gpt2_tokenizer.bin beside the model file (llm.c keeps only the token
        bytes; the merges follow from them); None, with a warning, where there is none or it is not GPT-2's."""
        path = self.path.parent / TOKENIZER_FILE
        if not path.is_file():
            self.warnings.append(f"{self.path}: no tokenizer beside it ({TOKENIZER_FILE}); {NO_TOKENIZER}")
            return None
        try:
            return vocab_and_merges(*read_tokenizer(path), str(path))
        except GPT2PortError as e:
            self.warnings.append(f"{e}; {NO_TOKENIZER}")
            return None


def _config(fields: dict, path: Path) -> GPTConfig:
    return GPTConfig.from_hf_config(fields, str(path))


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
    ints, size = _read_header(path, TOKENIZER_MAGIC, (TOKENIZER_VERSION,))
    n, eot = ints[2], ints[3]
    data = np.fromfile(path, dtype=np.uint8, offset=HEADER_BYTES).tobytes()
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


def open_bin(path: Path, pickle_reader) -> Reader:
    """`.bin` is PyTorch's pickle suffix and llm.c's: llm.c's files start with their magic number, a pickle with a
    zip signature (PK) or a pickle opcode (0x80)."""
    magic = magic_of(path)
    if magic == MODEL_MAGIC:
        return LlmcReader(path)
    if magic is not None:
        raise GPT2PortError(f"{path}: is llm.c's {_KIND[magic]} file, not a model file")
    with open(path, "rb") as f:
        head = f.read(4)
    if head[:2] == b"PK" or head[:1] == b"\x80" or head.startswith(b"version"):
        return pickle_reader(path)
    found = struct.unpack("<i", head)[0] if len(head) == 4 else None
    raise GPT2PortError(f"{path}: neither a PyTorch pickle nor an llm.c model file (magic {found}, llm.c's is "
                        f"{MODEL_MAGIC})")
