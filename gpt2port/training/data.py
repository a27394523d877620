"""Fine-tuning data as tokens: tokenized once into a cache (train.bin and val.bin: raw little-endian token ids, the
format nanoGPT's train.bin uses, plus meta.json), memory-mapped for training, and sampled so that any step's batch
is known from the seed and the step alone.

Each document (a text file, a JSON line) is preceded by <|endoftext|>, as GPT-2 saw documents in training. The
held-out split is the end of the token stream. Text that happens to contain "<|endoftext|>" is ordinary text.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpt2port import inputs, records
from gpt2port.errors import GPT2PortError
from gpt2port.filekind import real
from gpt2port.fsio import make_stage, missing_parents, remove_if_empty, sweep_leftovers, write_file, write_mark
from gpt2port.hashing import hash_file
from gpt2port.progress import StatusLine
from gpt2port.signals import sigterm_as_interrupt
from gpt2port.tokenizer import TOKENIZER_FILES, from_directory
from gpt2port.training.text import documents, pieces

FORMAT = "gpt2port-tokens/1"
SCAN = 1 << 24  # token ids checked at a time in a cache found on disk (32 MB of uint16)
BATCH = 16  # pieces handed to the tokenizer's threads at once: at most ~16 MB of text, so a Ctrl-C waits one batch

__all__ = ["documents", "prepare", "TokenCache", "sample_offsets", "eval_offsets", "windows"]


@dataclass
class TokenCache:
    dir: Path
    train: np.ndarray
    val: np.ndarray
    meta: dict


def prepare(data: str | Path, tokenizer_dir: Path, cache_dir: Path, *, block_size: int,
            val_fraction: float = 0.05, quiet: bool = False, vocab_size: int | None = None) -> TokenCache:
    """The token cache of `data` in cache_dir: reused when made from the same files (path, size, mtime) with the
    same tokenizer and split, else built aside and renamed into place (a failure or Ctrl-C leaves nothing). A
    cache reused is checked first: its meta.json, each .bin's length against it, every id below the vocabulary
    (vocab_size: the model's, where it is smaller than the tokenizer's)."""
    files = documents(data)
    sources = [{"path": str(real(f)), "size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns} for f in files]
    recipe = {"format": FORMAT, "sources": sources, "tokenizer": _fingerprint(Path(tokenizer_dir)),
              "val_fraction": val_fraction, "block_size": block_size}
    cache_dir = Path(cache_dir)
    meta = _read_meta(cache_dir)
    if meta is None or any(meta.get(k) != v for k, v in recipe.items()):
        return _open(cache_dir, _build(files, Path(tokenizer_dir), cache_dir, recipe, quiet, Path(data)))
    return _open(cache_dir, meta, vocab_size or 1 << 32)


def _fingerprint(tokenizer_dir: Path) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        p = tokenizer_dir / name
        if p.is_file():
            h.update(name.encode() + b"\0" + inputs.read_bytes(p, inputs.LIMITS["tokenizer"], "a tokenizer file"))
    return h.hexdigest()


def _read_meta(cache_dir: Path) -> dict | None:
    try:
        return inputs.read_json(cache_dir / "meta.json")
    except (OSError, GPT2PortError):
        return None


def _build(files: list[Path], tokenizer_dir: Path, cache_dir: Path, recipe: dict, quiet: bool, data: Path) -> dict:
    enc = from_directory(tokenizer_dir)
    dtype = np.uint16 if enc.n_vocab <= 1 << 16 else np.uint32
    stage = cache_dir.parent / f".{cache_dir.name}.partial-{os.getpid()}"
    status = StatusLine("tokenizing", quiet)
    t0 = time.perf_counter()
    created = missing_parents(cache_dir.parent)  # removed again if this fails: a refusal leaves no trace
    # Ctrl-C is seen between batches (a pending piece is never started); SIGTERM ends the work as Ctrl-C does.
    pool = ThreadPoolExecutor(os.cpu_count() or 1)
    try:
        sweep_leftovers(cache_dir)  # a stage left by a run that was killed (its process is gone)
        shutil.rmtree(stage, ignore_errors=True)
        make_stage(stage)
        n, docs = 0, 0
        with sigterm_as_interrupt(), open(stage / "train.bin", "wb") as out:
            batch: list[tuple[bool, str]] = []
            for piece in pieces(files):
                batch.append(piece)
                if len(batch) == BATCH:
                    n, docs = _flush(enc, pool, batch, out, dtype, n, docs)
                    batch = []
                    status(f"{n:,} tokens")
            n, docs = _flush(enc, pool, batch, out, dtype, n, docs)
        status(None)
        n_val = max(math.ceil(recipe["val_fraction"] * n), recipe["block_size"] + 1)
        if n - n_val < recipe["block_size"] + 1:
            raise GPT2PortError(f"{data}: {n:,} tokens; block size "
                                f"{recipe['block_size']} needs at least {2 * (recipe['block_size'] + 1):,} (a block "
                                f"and one more token for training, as many held out)")
        files = _split(stage, n - n_val, n_val, dtype)
        seconds = time.perf_counter() - t0
        meta = {**recipe, "dtype": np.dtype(dtype).name, "eot": enc.eot_token, "vocab_size": enc.n_vocab,
                "n_train": n - n_val, "n_val": n_val, "n_documents": docs,
                "tokens_per_s": round(n / seconds) if seconds > 0 else None}
        write_mark(stage / "meta.json", meta, files)  # sealed, recording both files (records.py)
        if cache_dir.exists():
            shutil.rmtree(cache_dir)
        stage.rename(cache_dir)
        return meta
    except BaseException:
        status(None)
        pool.shutdown(wait=True, cancel_futures=True)  # the pieces being encoded finish; the rest never start
        shutil.rmtree(stage, ignore_errors=True)
        remove_if_empty(created)
        raise
    finally:
        pool.shutdown(wait=False)


def _flush(enc, pool, batch, out, dtype, n: int, docs: int) -> tuple[int, int]:
    if not batch:
        return n, docs
    encoded = [f.result() for f in [pool.submit(enc.encode_ordinary, text) for _, text in batch]]
    for (starts, _), ids in zip(batch, encoded):
        if starts:
            ids = [enc.eot_token, *ids]
            docs += 1
        np.asarray(ids, dtype=dtype).tofile(out)
        n += len(ids)
    return n, docs


def _split(stage: Path, n_train: int, n_val: int, dtype) -> dict[str, dict]:
    """The last n_val tokens of the stream into val.bin; train.bin cut to the rest (no second copy of it). Returns
    the record of both (train.bin hashed once cut: where it ends is known only now)."""
    size = np.dtype(dtype).itemsize
    with open(stage / "train.bin", "r+b") as f:
        f.seek(n_train * size)
        tail = f.read(n_val * size)
        f.truncate(n_train * size)
    with records.recording(stage) as record:
        write_file(stage / "val.bin", tail)
    record.add(stage / "train.bin", n_train * size, hash_file(stage / "train.bin")[0])
    return record.files


def _open(cache_dir: Path, meta: dict, vocab_size: int | None = None) -> TokenCache:
    """The cache's two splits, memory-mapped; with vocab_size (a cache found, not just built), its meta.json and
    bytes are checked first: a damaged cache is refused naming the file, never mapped past its end."""
    if vocab_size is not None:
        _check_meta(cache_dir / "meta.json", meta, vocab_size)

    def mapped(name: str, n: int) -> np.ndarray:
        path = cache_dir / name
        if vocab_size is not None:
            size, want = path.lstat().st_size if path.is_file() else -1, n * np.dtype(meta["dtype"]).itemsize
            if size != want:
                raise GPT2PortError(f"{path}: {max(size, 0):,} bytes, but meta.json says {n:,} tokens of "
                                    f"{meta['dtype']} ({want:,} bytes): the token cache is damaged (remove "
                                    f"{cache_dir} to tokenize again)")
        ids = np.memmap(inputs.checked(path), dtype=meta["dtype"], mode="r", shape=(n,))
        if vocab_size is not None:
            top = max((int(ids[i : i + SCAN].max()) for i in range(0, n, SCAN)), default=0)
            if top >= min(vocab_size, meta["vocab_size"]):
                raise GPT2PortError(f"{path}: holds token id {top}, beyond the vocabulary "
                                    f"({min(vocab_size, meta['vocab_size'])}): the token cache is damaged (remove "
                                    f"{cache_dir} to tokenize again)")
        return ids

    return TokenCache(cache_dir, mapped("train.bin", meta["n_train"]), mapped("val.bin", meta["n_val"]), meta)


def _check_meta(path: Path, meta: dict, vocab_size: int) -> None:
    def whole(k: str, lo: int) -> bool:
        return isinstance(meta.get(k), int) and not isinstance(meta.get(k), bool) and lo <= meta[k] < 1 << 62

    low = meta["block_size"] + 1  # the recipe matched: block_size is the run's
    if meta.get("dtype") not in ("uint16", "uint32") or not whole("n_train", low) or not whole("n_val", low) \
            or not whole("vocab_size", 1) or meta["vocab_size"] > np.iinfo(meta["dtype"]).max + 1:
        raise GPT2PortError(f"{path}: not a token cache's meta.json (dtype, n_train, n_val, vocab_size) (remove "
                            f"{path.parent} to tokenize again)")


def sample_offsets(n_tokens: int, block_size: int, *, seed: int, step: int, count: int) -> np.ndarray:
    """Window starts of optimizer step `step`, uniform over [0, n_tokens - block_size - 1], from a generator
    seeded by (seed, step) alone: a resumed run and any number of ranks draw the same global batch."""
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, n_tokens - block_size, size=count, dtype=np.int64)


def eval_offsets(n_tokens: int, block_size: int, max_windows: int) -> np.ndarray:
    """Fixed, evenly spread, non-overlapping window starts over the held-out split: the same at every evaluation."""
    fits = (n_tokens - 1) // block_size
    k = max(1, min(max_windows, fits))
    if k == fits:
        return np.arange(k, dtype=np.int64) * block_size
    stride = (n_tokens - 1 - block_size) / (k - 1) if k > 1 else 0
    return np.floor(np.arange(k) * stride).astype(np.int64)


def windows(tokens: np.ndarray, offsets, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 (len(offsets), block_size): inputs and the next tokens."""
    rows = np.stack([np.asarray(tokens[o : o + block_size + 1], dtype=np.int64) for o in offsets])
    xy = torch.from_numpy(rows)
    return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
