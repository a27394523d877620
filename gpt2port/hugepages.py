"""Weights in memory the kernel backs with 2 MB pages, for the int8 decode step (gpt2port.quant).

A decode step reads every weight once: at 124M in int8, ~124 MB spread over ~30,000 4 KB pages, far more than the
CPU's TLB holds, so the step also walks page tables for most of them. fbgemm's int8 kernel reads its own packed copy
of each weight, allocated inside PyTorch with malloc, where gpt2port cannot hand it memory of its choosing. On Linux
with transparent huge pages in "madvise" mode (a common default), such memory gets 2 MB pages only where
madvise(MADV_HUGEPAGE) marked it before its pages were first touched. So, before the weights are quantized and
packed, `huge_pages(nbytes)` makes glibc's heap hold a large free, untouched, marked region that the allocations
made next are carved from:

1. malloc 30 MB blocks, for nbytes in all. glibc maps a block that large on its own until it has freed one it
   mapped, after which it serves that size from its heap (its rule for raising its mmap threshold; nothing is
   configured): a mapped block is freed at once, and the rest are carved one after another off the heap's top;
2. madvise the 2 MB-aligned span they cover with MADV_HUGEPAGE, and free every block of it but the last, which
   keeps the span from being returned to the system (freed memory next to the heap's top is trimmed) until the
   exit. Blocks that glibc took from free memory elsewhere in its heap are held until the exit too.

Freed, the blocks merge into one free region, from which glibc then serves this thread's large and small requests
(it uses free memory before growing the heap or mapping more). glibc picks the smallest free block that fits, so in
a process whose heap already holds free blocks of its own, some allocations land there instead, in whatever pages
those have: a model loaded early in a program, as usual, gets the most from this. On exit the held blocks are
freed and glibc is asked to return unused free pages (malloc_trim), so what the load did not use costs no memory.

Where any step does not hold (not Linux, not glibc, THP "always" or "never", another thread than the main one,
whose allocations go to another of glibc's arenas, blocks not laid out one after another) nothing is marked and
everything is allocated as before: only the speed differs, never a number. Measured on the 2-core EPYC VM the
README names: a 124M int8 step 9-13% shorter in A/B runs within one process, 11% on average over nine pairs of
fresh processes (scripts/bench_hugepages.py; single pairs -24% to +2% on that noisy machine), ~6% at 1.5B. fp32 (oneDNN, on the checkpoint's own
mapped pages) was not measurably faster at 124M with its weights copied into 2 MB pages, and is left as it is.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

# A switch for comparisons (scripts/bench_generate.py) and debugging: False allocates as glibc would anyway.
ENABLED = True
MB = 1 << 20
PAGE = 2 * MB
# Below glibc's largest automatic mmap threshold (32 MB): once glibc has mapped and freed one block this size, it
# serves blocks of this size from its heap, carving them one after another off its top.
_BLOCK = 30 * MB
_MADV_HUGEPAGE = 14
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@contextlib.contextmanager
def huge_pages(nbytes: int) -> Iterator[bool]:
    """Within, up to ~nbytes that this thread allocates with malloc lie in 2 MB pages where the system allows it
    (see the module's docstring). Yields whether the region was set up."""
    main = threading.current_thread() is threading.main_thread()
    held = _reserve(nbytes) if ENABLED and main and _supported() else []
    try:
        yield bool(held)
    finally:
        if held:
            libc = _libc()
            for block in held:
                libc.free(block)
            libc.malloc_trim(0)


def _reserve(nbytes: int) -> list[int]:
    """Set up the marked free region; returns the blocks to free on exit (none where nothing was marked): the one
    after the region, which keeps it in place, and those glibc handed out from free memory elsewhere in its heap,
    held so that the allocations to come are carved from the marked region rather than from there."""
    libc = _libc()
    wanted = max(2, -(-nbytes // _BLOCK) + 1)
    blocks: list[int] = []  # what glibc handed out from its heap; the last `run` of them lie one after another
    run = 0
    for _ in range(wanted + 16):
        block = libc.malloc(_BLOCK)
        if not block:
            break
        if _mapped(block):  # glibc mapped it on its own; once this is freed, blocks this size come from the heap
            libc.free(block)
            continue
        # Carved off the top one after another, each block starts a chunk header past the end of the one before;
        # the first ones may come from free memory elsewhere in the heap.
        run = run + 1 if blocks and _BLOCK <= block - blocks[-1] <= _BLOCK + 64 else 1
        blocks.append(block)
        if run == wanted:
            break
    span, pin = blocks[len(blocks) - run:], blocks[-1] if blocks else 0
    start, end = (-(-span[0] // PAGE) * PAGE, pin // PAGE * PAGE) if span else (0, 0)
    if end - start < PAGE or libc.madvise(start, end - start, _MADV_HUGEPAGE) != 0:
        for block in blocks:
            libc.free(block)
        return []
    for block in span[:-1]:
        libc.free(block)
    return blocks[: len(blocks) - run] + [pin]


def _mapped(block: int) -> bool:
    """Whether glibc served this block by mapping it rather than from its heap: the IS_MMAPPED bit (2) of the size
    word that glibc keeps just before every block it hands out."""
    return bool(ctypes.c_size_t.from_address(block - ctypes.sizeof(ctypes.c_size_t)).value & 2)


@functools.cache
def _supported() -> bool:
    """Linux, glibc, THP in "madvise" mode (with "always" the heap gets 2 MB pages anyway)."""
    if sys.platform != "linux":
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc") or "[madvise]" not in _THP_MODE.read_text():
            return False
        _libc()
    except (OSError, ValueError, AttributeError):
        return False
    return True


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
    libc.madvise.restype, libc.madvise.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.malloc_trim.restype, libc.malloc_trim.argtypes = ctypes.c_int, [ctypes.c_size_t]
    return libc
