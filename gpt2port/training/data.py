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

from gpt2port import jsonio
from gpt2port.errors import GPT2PortError
from gpt2port.fsio import make_stage, missing_parents, remove_if_empty, sweep_leftovers, write_json
from gpt2port.progress import StatusLine
from gpt2port.signals import sigterm_as_interrupt
from gpt2port.tokenizer import TOKENIZER_FILES, from_directory
from gpt2port.training.text import documents, pieces

FORMAT = "gpt2port-tokens/1"
BATCH = 16  # pieces handed to the tokenizer's threads at once: at most ~16 MB of text, a second or two of work

__all__ = ["documents", "prepare", "TokenCache", "sample_offsets", "eval_offsets", "windows"]


@dataclass
class TokenCache:
    dir: Path
    train: np.ndarray
    val: np.ndarray
    meta: dict


def prepare(data: str | Path, tokenizer_dir: Path, cache_dir: Path, *, block_size: int,
            val_fraction: float = 0.05, quiet: bool = False) -> TokenCache:
    """The token cache of `data` in cache_dir: reused when made from the same files (path, size, mtime) with the
    same tokenizer and split, else built aside and renamed into place (a failure or Ctrl-C leaves nothing)."""
    files = documents(data)
    sources = [{"path": str(f.resolve()), "size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns} for f in files]
    recipe = {"format": FORMAT, "sources": sources, "tokenizer": _fingerprint(Path(tokenizer_dir)),
              "val_fraction": val_fraction, "block_size": block_size}
    cache_dir = Path(cache_dir)
    meta = _read_meta(cache_dir)
    if meta is None or any(meta.get(k) != v for k, v in recipe.items()):
        meta = _build(files, Path(tokenizer_dir), cache_dir, recipe, quiet, Path(data))
    return _open(cache_dir, meta)


def _fingerprint(tokenizer_dir: Path) -> str:
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        p = tokenizer_dir / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def _read_meta(cache_dir: Path) -> dict | None:
    try:
        return jsonio.read(cache_dir / "meta.json")
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
        _split(stage, n - n_val, n_val, dtype)
        seconds = time.perf_counter() - t0
        meta = {**recipe, "dtype": np.dtype(dtype).name, "eot": enc.eot_token, "vocab_size": enc.n_vocab,
                "n_train": n - n_val, "n_val": n_val, "n_documents": docs,
                "tokens_per_s": round(n / seconds) if seconds > 0 else None}
        write_json(stage / "meta.json", meta)
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


def _split(stage: Path, n_train: int, n_val: int, dtype) -> None:
    """The last n_val tokens of the stream into val.bin; train.bin cut to the rest (no second copy of it)."""
    size = np.dtype(dtype).itemsize
    with open(stage / "train.bin", "r+b") as f:
        f.seek(n_train * size)
        tail = f.read(n_val * size)
        f.truncate(n_train * size)
    (stage / "val.bin").write_bytes(tail)


def _open(cache_dir: Path, meta: dict) -> TokenCache:
    def mapped(name: str, n: int) -> np.ndarray:
        return np.memmap(cache_dir / name, dtype=meta["dtype"], mode="r", shape=(n,))

    return TokenCache(cache_dir, mapped("train.bin", meta["n_train"]), mapped("val.bin", meta["n_val"]), meta)


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
