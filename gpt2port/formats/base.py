"""What every file format offers: the tensors it holds (name, dtype, shape) before any is read, then one at a time.

A reader never interprets names: "wte.weight" or "blocks.0.attn.qkv.weight" are strings to it. What a name means,
and how a tensor must be reshaped to mean it, belongs to gpt2port.layouts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2port import hashing, inputs
from gpt2port.errors import GPT2PortError

FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
LFS_POINTER_PREFIX = b"version https://git-lfs"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    offset: int = 0  # where its bytes start in `file`, for reading in file order (0 where the format has no order)
    nbytes: int = 0
    # How the stored bytes encode the values, where they are not plain `dtype` (GGUF's "q8_0", read dequantized to
    # `dtype`): such bytes are never copied as they are.
    encoding: str | None = None


class Reader:
    """One opened weights source. `tensors` lists every tensor in file order; read(name) loads just that one.

    Subclasses set path (what was opened), files (every file the tensors come from, in order), index_file (a file
    that only lists others, or None), tensors and metadata, and implement read(). layout, model_config and
    embedded_tokenizer() are what a file means, set only by the readers that know it (gpt2port.readers).
    """

    path: Path
    files: list[Path]
    index_file: Path | None = None
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    # A file that always holds one layout (llm.c's, GGUF's) names it here; None: tell it by the names.
    layout: str | None = None
    # A file that carries the model's sizes in itself gives them as config.json fields (n_layer, n_head,
    # n_embd, vocab_size, n_positions, ...); None: they come from a config.json beside the file, or from shapes.
    model_config: dict | None = None
    config_file: Path | None = None  # the file model_config was read from, if it is one beside the weights
    config_keys: dict[str, str] = {}  # config.json's name -> the name model_config's source uses, where it differs
    # Findings a conversion should report (e.g. a tokenizer that could not be carried over).
    warnings: tuple[str, ...] | list[str] = ()
    # The session hashing the source for whoever opened it (a conversion), offered every piece read; None: nobody is.
    hashes: hashing.Hashes | None = None

    def inputs(self) -> list[Path]:
        """Every file this reader opened (an output must never replace one)."""
        return [f for f in (self.path, *self.files, self.index_file, self.config_file) if f is not None]

    def embedded_tokenizer(self) -> tuple[list[str], list[tuple[str, str]]] | None:
        """The tokens and merges the file itself carries (GGUF's embedded tokenizer, llm.c's gpt2_tokenizer.bin), as
        the readers that know them give them (gpt2port.readers); None where it carries none."""
        return None

    def read(self, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        """One tensor. `into`, a uint8 buffer of at least its nbytes, may receive the bytes (the result is then a
        view of it, valid until the next read into the same buffer); formats that cannot use it ignore it."""
        raise NotImplementedError

    def stream(self, name: str) -> "TensorStream | None":
        """The tensor's stored bytes, to be read piece by piece into buffers the caller gives; None where the format
        cannot (the caller reads it whole instead)."""
        return None

    def largest(self) -> int:
        return max((t.nbytes for t in self.tensors.values()), default=0)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def refuse_lfs_pointer(path: Path, head: bytes) -> None:
    """A Git LFS pointer saved in place of the weights (a clone without `git lfs pull`) is named as such."""
    if head.startswith(LFS_POINTER_PREFIX):
        raise GPT2PortError(f"{path}: is a Git LFS pointer file, not the weights (fetch the real file)")


class TensorStream:
    """One tensor's stored bytes read with pread, piece by piece, into buffers the caller gives: readinto(view)
    until info.nbytes are read, then finish() (a format's whole-tensor checks); close() in every case. Formats with
    more to check per piece (a checksum) override piece() and finish(). With `hashes` (the reader's session), each
    piece goes to the source's hash too: lent, where the caller tracks the buffer's loans (read_whole), or else for
    the hash to read again itself."""

    def __init__(self, info: TensorInfo, hashes: hashing.Hashes | None = None):
        self.info = info
        self.hashes = hashes
        self.done = 0
        self._fd = inputs.open_fd(info.file)

    def readinto(self, view, loans: hashing.Loans | None = None, at: int = 0) -> int:
        """Read the next bytes into `view`; with `loans`, lend them to the source's hash as the caller's buffer
        bytes from `at` on."""
        n = os.preadv(self._fd, [view], self.info.offset + self.done) if len(view) else 0
        if not n:
            raise GPT2PortError(f"{self.info.file}: ends inside tensor {self.info.name!r} (truncated?)")
        got = memoryview(view)[:n]
        if self.hashes is not None:
            where = self.info.offset + self.done
            if loans is None:  # a buffer that is not ours to lend: the hash reads these bytes itself
                self.hashes.offer(self._fd, where, n)
            else:
                loans.offer(self.hashes, self._fd, where, at, got)
        self.piece(got)
        self.done += n
        return n

    def piece(self, view: memoryview) -> None:
        """Bytes just read, while they are in cache."""

    def finish(self) -> None:
        if self.done != self.info.nbytes:
            raise GPT2PortError(f"{self.info.file}: ends inside tensor {self.info.name!r} (truncated?)")

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def read_whole(stream: TensorStream, into: torch.Tensor | None, loans: hashing.Loans, piece_bytes: int) -> torch.Tensor:
    """The whole tensor from `stream`, checked, as a tensor of its dtype and shape (see read_bytes)."""
    info = stream.info
    return read_bytes(stream, into, loans, piece_bytes).view(info.dtype).reshape(info.shape)


def read_bytes(stream: TensorStream, into: torch.Tensor | None, loans: hashing.Loans, piece_bytes: int) -> torch.Tensor:
    """The whole tensor's stored bytes from `stream`, checked, as uint8: read into `into` when it is a uint8
    buffer large enough (the result a view of it, valid until the next read into it; `loans` tracks its regions lent
    to the source's hash, and each is reclaimed before it is read over), else into fresh memory (reclaimed before
    it is returned: the caller may change it). Pieces of `piece_bytes`."""
    info = stream.info
    fresh = into is None or into.numel() < info.nbytes
    raw = torch.empty(info.nbytes, dtype=torch.uint8) if fresh else into[: info.nbytes]
    loans = hashing.Loans() if fresh else loans
    view = raw.numpy()
    try:
        while stream.done < info.nbytes:
            start, end = stream.done, min(stream.done + piece_bytes, info.nbytes)
            loans.reclaim(start, end)  # bytes of an earlier read still being hashed are not read over
            stream.readinto(view[start:end], loans, start)
        stream.finish()
    finally:
        stream.close()
    if fresh:
        loans.reclaim()
    return raw
