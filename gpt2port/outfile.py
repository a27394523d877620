"""How a large output file's bytes reach the disk: appended through O_DIRECT where the filesystem allows it, through
the page cache otherwise. Both behind one small interface, `open_append(path)`: write(buffer) any number of times
(tell() is the bytes so far), then close() (everything on disk, fsynced) or abort(); once closed or aborted, both
do nothing. Enough of a file object for a library that writes through one (the gguf writer).

Why O_DIRECT: a converter writes gigabytes it will not read back. Buffered, every byte is first copied into the
page cache by the kernel, under the dirty-page throttling and reclaim of a machine whose cache is already full, and
that copy was the largest single cost of a conversion (docs/performance.md has the figures). Direct writes hand
page-aligned buffers to the device, with no such copy. The cost is one user-space copy into an aligned chunk (the
data arrive in pieces of any size) and a file padded to a block, then truncated to its size.

Writer threads do the write calls (two, each writing whole chunks at their offsets), so the caller fills one chunk
while the device takes the others; a caller may also copy straight into the chunk being filled (space(), commit()).
Where O_DIRECT is missing (not Linux), refused at open (some filesystems), or a write is refused as direct I/O (a
filesystem that accepts the flag but not the I/O, a device wanting larger blocks), the same writes go through the
page cache instead: slower, same bytes.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading

import hashlib

from gpt2port import records
from gpt2port.hashing import StreamHash
from gpt2port.threads import out_of_memory, start_thread

BLOCK = 4096  # alignment of O_DIRECT offsets, lengths and buffers: a page, a multiple of every device block
CHUNK = 16 << 20  # bytes per write() call: large enough that the device streams
WRITERS = 2  # direct writes in flight at once: the device takes one while the other completes (docs/performance.md)
CHUNKS = WRITERS + 2  # chunk buffers: those being written, one being filled, one to spare
WRITE_SLICE = 4 << 20  # bytes per buffered write() call
_write = os.pwrite  # the one call that writes a direct chunk (a module attribute: the tests inject a full disk here)


def open_append(path, direct: bool | None = None):
    """A new file at `path` (which must not exist) to append to: a DirectAppend where O_DIRECT is accepted, else a
    BufferedAppend. direct False writes through the page cache; None: O_DIRECT unless the environment says
    GPT2PORT_DIRECT_IO=0 (for comparisons and debugging, and for the writers called deep inside a conversion).
    Raises OSError as open() would."""
    flag = getattr(os, "O_DIRECT", 0)
    if direct is None:
        direct = os.environ.get("GPT2PORT_DIRECT_IO", "1") != "0"
    if direct and flag:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flag | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError as e:
            if e.errno != errno.EINVAL:  # this filesystem refuses O_DIRECT; anything else is the caller's error
                raise
        else:
            return DirectAppend(fd, path)
    return BufferedAppend(open(path, "xb"), path)


class DirectAppend:
    """Appends through O_DIRECT: bytes gathered into page-aligned chunks, written whole by writer threads."""

    def __init__(self, fd: int, path=None):
        self._fd, self._path = fd, path
        self._free: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._hash: StreamHash | None = None
        try:
            for _ in range(CHUNKS):
                self._free.put(mmap.mmap(-1, CHUNK))  # anonymous mappings are page-aligned, as O_DIRECT wants
        except OSError as e:
            self.abort()
            if e.errno != errno.ENOMEM:
                raise
            raise out_of_memory(path, f"cannot map {CHUNKS} write buffers of {CHUNK >> 20} MB") from None
        self._full: queue.Queue = queue.Queue()
        self._error: OSError | None = None
        self._chunk, self._fill, self._size, self._offset = self._free.get(), 0, 0, 0
        self._threads = [threading.Thread(target=self._run, name="gpt2port-writer", daemon=True)
                         for _ in range(WRITERS)]
        try:
            for t in self._threads:
                start_thread(t, path)
            self._hash = StreamHash(path)
        except BaseException:
            self.abort()
            raise

    def write(self, data) -> int:
        if self._fd < 0:
            raise ValueError("write to a closed DirectAppend")
        view = memoryview(data).cast("B")
        written = len(view)
        self._size += written
        while len(view):
            n = min(len(view), CHUNK - self._fill)
            self._chunk[self._fill : self._fill + n] = view[:n]
            self._fill += n
            view = view[n:]
            if self._fill == CHUNK:
                self._submit(CHUNK)
        return written

    def space(self) -> memoryview:
        """The free end of the chunk being filled (never empty), lent to the caller to copy into directly; then
        commit(n) for the first n bytes copied. The view must not be used after commit."""
        return memoryview(self._chunk)[self._fill :]

    def commit(self, n: int) -> None:
        self._fill += n
        self._size += n
        if self._fill == CHUNK:
            self._submit(CHUNK)

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        """Nothing to do: a chunk goes out when full, the rest at close()."""

    def _submit(self, length: int, data: int | None = None) -> None:
        """Hand the chunk on: hashed first (its first `data` bytes, all by default; the rest is padding), then to
        the writers, in order; the caller goes on with a free chunk meanwhile."""
        if self._error is not None:
            raise self._error
        chunk, offset = self._chunk, self._offset
        self._hash.update(memoryview(chunk)[: length if data is None else data],
                          lambda: self._full.put((chunk, length, offset)))
        self._offset += length
        self._chunk, self._fill = self._free.get(), 0

    def _run(self) -> None:
        while (got := self._full.get()) is not None:
            chunk, length, offset = got
            if self._error is None:  # after an error, chunks are only handed back: the caller raises at its next
                try:
                    _write_all(self._fd, memoryview(chunk)[:length], offset)
                except OSError as e:
                    self._error = e
                except BaseException as e:  # noqa: BLE001 - any failure must reach the caller, not end the thread
                    self._error = OSError(f"writer thread: {e!r}")
            self._free.put(chunk)

    def close(self) -> None:
        """Write the rest (padded to a block, then the file truncated to its true size), fsync, close. On an error
        the file is closed all the same (abort() after it does nothing)."""
        if self._fd < 0:
            return
        try:
            if self._fill:
                padded = -(-self._fill // BLOCK) * BLOCK
                self._chunk[self._fill : padded] = bytes(padded - self._fill)
                self._submit(padded, self._fill)
            digest = self._hash.hexdigest()
            self._stop()
            if self._error is not None:
                raise self._error
            os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        finally:
            self.abort()
        records.written(self._path, self._size, digest)

    def abort(self) -> None:
        """Stop the writer threads and close the file, whatever state it is in (once: later calls do nothing)."""
        if self._hash is not None:
            self._hash.abort()  # first: it hands the chunks it holds on to the writers
        self._stop()
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            try:
                os.close(fd)
            except OSError:
                pass

    def _stop(self) -> None:
        for _ in (t for t in self._threads if t.ident is not None and t.is_alive()):
            self._full.put(None)
        for t in self._threads:
            if t.ident is not None:  # started
                t.join()


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    """os.pwrite at `offset` until every byte is written. A write refused with EINVAL while O_DIRECT is on (a
    filesystem that accepted the flag at open but not the I/O, or wants other alignment) wrote nothing: the flag is
    dropped and the same bytes go through the page cache, this write and every later one. A write refused so while
    the other writer was dropping the flag is retried once; EINVAL for any other reason recurs then, and is raised."""
    retried = False
    while len(view):
        try:
            n = _write(fd, view, offset)
        except OSError as e:
            import fcntl  # here, not at the top: DirectAppend exists only where O_DIRECT does (not on Windows)

            if e.errno != errno.EINVAL or retried:
                raise
            with _flag_lock:
                flags = fcntl.fcntl(fd, fcntl.F_GETFL)
                if flags & os.O_DIRECT:
                    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            retried = True
            continue
        view, offset = view[n:], offset + n


_flag_lock = threading.Lock()  # one writer at a time drops O_DIRECT


class BufferedAppend:
    """Appends through the page cache (write_in_slices, BackgroundFlusher below)."""

    def __init__(self, file, path=None):
        self._file, self._path = file, path
        self._flusher = BackgroundFlusher(file.fileno(), path)
        self._sha = hashlib.sha256()  # here, not on a thread: the caller may change its buffer once write returns

    def write(self, data) -> int:
        write_in_slices(self._file, data, self._flusher)
        self._sha.update(memoryview(data).cast("B"))
        return memoryview(data).nbytes

    def tell(self) -> int:
        return self._file.tell()

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if self._file.closed:
            return
        try:
            self._file.flush()
            self._flusher.finish()
            os.fsync(self._file.fileno())
        except OSError:
            self.abort()
            raise
        size = self._file.tell()
        self._file.close()  # on network filesystems a delayed write error can surface only here
        records.written(self._path, size, self._sha.hexdigest())

    def abort(self) -> None:
        """Stop flushing and close, quietly: this runs while a failure is being reported, and on a full disk close()
        retries the buffered bytes and raises ENOSPC again, which would replace the one line naming the file."""
        self._flusher.abort()
        try:
            self._file.close()
        except OSError:
            pass


def write_in_slices(file, data, flusher: "BackgroundFlusher | None" = None) -> None:
    """Append `data` (any buffer) to an open binary file a few MB per write() call: one write() of a whole 300 MB
    tensor runs several times slower than the same bytes in slices, as the kernel throttles a process that dirties
    many pages at once (README, performance)."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), WRITE_SLICE):
        file.write(view[start:start + WRITE_SLICE])
    if flusher is not None:
        flusher.wrote(len(view))


class BackgroundFlusher:
    """fdatasync on a second thread every FLUSH_EVERY bytes, so the disk writes while we convert and the final
    fsync has little left to wait for. Errors surface at finish()."""

    FLUSH_EVERY = 256 << 20

    def __init__(self, fd: int, path=None):
        self._fd = fd
        self._path = path
        self._pending = 0
        self._wake = threading.Event()
        self._done = False
        self._error: OSError | None = None
        self._thread: threading.Thread | None = None

    def wrote(self, n: int) -> None:
        self._pending += n
        if self._pending >= self.FLUSH_EVERY:
            self._pending = 0
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True)
                start_thread(self._thread, self._path)
            self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._done:
                return
            try:
                os.fdatasync(self._fd)
            except OSError as e:
                self._error = e
                return

    def finish(self) -> None:
        if self._thread is not None:
            self._done = True
            self._wake.set()
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error

    def abort(self) -> None:
        """Stop the thread of a write that is failing anyway; its flush error, if any, would only hide the cause."""
        try:
            self.finish()
        except OSError:
            pass


# What each command can be asked to hold less of, named in its out-of-memory line.
LOWER = {"eval": "--batch-tokens (or use --dtype bf16)", "finetune": "--batch-size or --block-size",
         "generate": "--max-new-tokens (or use --dtype int8)", "verify": "--tokens"}


def out_of_memory_line(command: str) -> str:
    """The one line for a command that ran out of memory: the command, the address-space limit if any, and the
    option that asks for less."""
    lower = f"; lower {LOWER[command]}" if command in LOWER else ""
    return f"{out_of_memory(f'gpt2port {command}')}{lower}"
