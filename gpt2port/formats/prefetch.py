"""Lay the next tensors out on a worker thread while the caller writes the ones before them.

A conversion reads, checks, transposes and writes every tensor. Done by one thread, the second core idles while
the first copies bytes into the page cache, and the transposes wait for the writes. Here a worker thread calls each
item's produce() and copies the tensor, in the declared dtype and row-major order, into a small ring of chunk
buffers; the caller takes the chunks in order and writes them. The two overlap, and memory grows by the ring (a few
chunks), not by a second copy of the largest tensor.

Given a sink that lends its own buffers (an O_DIRECT appender: `space()` and `commit(n)`, see outfile.py), the worker
copies each tensor straight into the file's next chunk instead, and the caller only waits for each tensor to be
done: no ring, and no second copy from the ring into the chunk (0.7 s of CPU time at 1.5B here).

Every tensor is copied into the ring, even one already in the declared dtype and order: produce() may return a
view of a buffer its next call reuses (a reader's read buffer), and the worker calls it again while the caller is
still writing the chunks of the previous tensor.
"""

from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from gpt2port.errors import GPT2PortError
from gpt2port.threads import start_thread

TILE = 256  # columns per block of a transposing copy (measured best of 32..512 at GPT-2's sizes)
CHUNK_BYTES = 16 << 20  # large enough that a write() call's overhead vanishes, small enough to stay in the LLC's reach
RING = 4  # chunks in flight: the worker keeps ahead through a slow write without holding much memory

_END = object()  # the last chunk of a tensor has been handed over


class Prefetcher:
    """Iterate as `for name, chunks in Prefetcher(items)`: the items [(name, dtype, shape, produce)] in order, each
    with an iterator of memoryviews of its bytes (each valid until the next is taken), or, given a sink that lends
    its buffers, of one int: the tensor's bytes, already in the sink. Take every chunk of a tensor
    before the next tensor. Leaving the loop early, or an error on either side, stops the worker; an error raised by
    a produce() is raised again here, at the tensor it belongs to."""

    def __init__(self, items, chunk_bytes: int = CHUNK_BYTES, ring: int = RING, sink=None):
        self._items = list(items)
        self._sink = sink if hasattr(sink, "space") else None
        rows = (_row_bytes(shape, dtype) for _, dtype, shape, _ in self._items)
        self._size = max([chunk_bytes, *rows])  # one row never splits: a chunk holds at least one
        self._free: queue.Queue = queue.Queue()
        for _ in range(0 if self._sink else ring):
            self._free.put(torch.empty(self._size, dtype=torch.uint8))
        self._ready: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpt2port-prefetch", daemon=True)

    def __iter__(self) -> Iterator[tuple[str, Iterator[memoryview]]]:
        # torch's own worker threads would compete with this pipeline's two for the same cores, and they spin
        # between operations (a conversion measured slower with them: docs/performance.md). Restored after.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        start_thread(self._thread, "reading the weights")
        try:
            for name, *_ in self._items:
                yield name, self._chunks()
        finally:
            self.close()
            torch.set_num_threads(threads)

    def close(self) -> None:
        """Stop the worker and wait for it: no read of a source may outlive the conversion that started it."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _chunks(self) -> Iterator[memoryview]:
        while True:
            got = self._ready.get()
            if got is _END:
                return
            if isinstance(got, BaseException):
                raise got
            if isinstance(got, int):  # bytes poured into the sink
                yield got
                continue
            buf, n = got
            try:
                yield memoryview(buf[:n].numpy())
            finally:
                self._free.put(buf)  # written (or abandoned): the worker may fill it again

    def _run(self) -> None:
        try:
            for name, dtype, shape, produce in self._items:
                tensor = produce()
                if isinstance(tensor, Streamed) and self._sink is None:
                    tensor = tensor.whole()  # the ring takes tensors in memory
                if not isinstance(tensor, Streamed):
                    tensor = tensor.detach().cpu()
                    if tuple(tensor.shape) != tuple(shape):
                        raise GPT2PortError(f"internal error: {name} was produced with shape "
                                            f"{tuple(tensor.shape)}, declared {tuple(shape)}")
                if self._sink is not None:
                    before = self._sink.tell()
                    if isinstance(tensor, Streamed):
                        _pour_stream(tensor, dtype, self._sink, self._stop)
                    else:
                        _pour(tensor, dtype, self._sink, self._stop)
                    self._ready.put(self._sink.tell() - before)  # the caller counts the bytes it did not see
                else:
                    for piece in _pieces(tensor, self._size // max(_row_bytes(shape, dtype), 1)):
                        buf = self._take()
                        if buf is None:
                            return
                        n = piece.numel() * dtype.itemsize
                        _copy(buf[:n].view(dtype).view(piece.shape), piece)  # transpose and cast in this one copy
                        self._ready.put((buf, n))
                self._ready.put(_END)
                if self._stop.is_set():
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread, which raises it
            self._ready.put(e)

    def _take(self) -> torch.Tensor | None:
        while not self._stop.is_set():
            try:
                return self._free.get(timeout=0.05)
            except queue.Empty:
                continue
        return None


@dataclass
class Streamed:
    """What a produce() may return instead of a tensor: one stored exactly as it is to be written, to be copied in
    pieces (open() -> a formats.base.TensorStream) straight into the sink, each piece passed to check() as it lands;
    whole() gives the tensor in memory, for the ring (a sink that does not lend its buffers)."""
    nbytes: int
    open: Callable[[], object]
    check: Callable[[torch.Tensor], None]
    whole: Callable[[], torch.Tensor]


def _row_bytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape[1:]) * dtype.itemsize if len(shape) else dtype.itemsize


def _pieces(tensor: torch.Tensor, rows: int) -> Iterator[torch.Tensor]:
    """The tensor as consecutive slices of at most `rows` rows along its first dimension (views, no copy)."""
    if tensor.dim() == 0:
        yield tensor.reshape(1)
        return
    for start in range(0, tensor.shape[0], rows):
        yield tensor[start : start + rows]


def _pour(tensor: torch.Tensor, dtype: torch.dtype, sink, stop: threading.Event) -> None:
    """Copy `tensor`, cast to `dtype`, row-major, into the sink's lent space, as many whole rows at a time as the
    space holds; a row cut by the end of a chunk goes through sink.write (one row, a few KB, per chunk). A set `stop`
    ends it early (the caller has given up on the output)."""
    rows = tensor.reshape(tensor.shape[0], -1) if tensor.dim() >= 2 else tensor.reshape(-1, 1)
    row_bytes = rows.shape[1] * dtype.itemsize
    done = 0
    while done < rows.shape[0] and not stop.is_set():
        space = sink.space()
        fit = min(len(space) // row_bytes, rows.shape[0] - done)
        if fit:
            dst = torch.frombuffer(space, dtype=torch.uint8, count=fit * row_bytes)
            _copy(dst.view(dtype).view(fit, rows.shape[1]), rows[done : done + fit])
            del dst  # the chunk may go to the disk at commit: no view of it outlives this
            sink.commit(fit * row_bytes)
            done += fit
        else:
            row = rows[done].to(dtype).contiguous()
            sink.write(memoryview(row.view(torch.uint8).numpy()))
            done += 1


def _pour_stream(item: Streamed, dtype: torch.dtype, sink, stop: threading.Event) -> None:
    """Read a Streamed tensor's bytes straight into the sink's lent space, piece by piece; its format's checks
    (a checksum) run when the last piece is in, before the caller counts it written."""
    stream = item.open()
    try:
        done = 0
        while done < item.nbytes and not stop.is_set():
            space = sink.space()
            n = stream.readinto(space[: min(len(space), item.nbytes - done)])
            if n >= dtype.itemsize:
                piece = torch.frombuffer(space, dtype=torch.uint8, count=n - n % dtype.itemsize)
                item.check(piece.view(dtype))
                del piece  # the chunk may go to the disk at commit: no view of it outlives this
            sink.commit(n)
            done += n
        if not stop.is_set():
            stream.finish()
    finally:
        stream.close()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src). A transposed 2-D source (a weight stored (in, out) going out as (out, in)) is copied in
    blocks of TILE columns: each block's source rows and destination rows then stay in cache, where a plain copy
    walks the source a column at a time (measured faster: docs/performance.md)."""
    if src.dim() == 2 and src.stride(0) < src.stride(1):
        for c in range(0, src.shape[1], TILE):
            dst[:, c : c + TILE].copy_(src[:, c : c + TILE])
    else:
        dst.copy_(src)
