"""sha256 of source files, computed beside the work that reads them; and of outputs as they are written
(StreamHash, for records.py).

A conversion records every source file's sha256 in its manifest. For a large checkpoint that is as much CPU time
as any other part of a conversion, so it must not sit on its path.

- Each file is hashed on a thread of its own (hashlib releases the GIL while it hashes).
- Readers hand it the bytes they read (`Hashes.offer`), so each byte comes out of the page cache once, not twice.
  Until a reader offers anything, the hasher reads on its own. Once a reader offers pieces, the hasher stops
  reading ahead: it drops pieces behind where it has got to, waits for the reader to come up, and then takes the
  reader's pieces, reading itself only a gap before an offered piece and, at the end (result()), whatever no reader
  offered. On a machine with few cores a hasher reading ahead takes CPU time from the reader, the slower of the
  two. Either way the file is hashed in order, each byte once.
- An offered piece is a view of the reader's own buffer, not a copy: the reader must leave those bytes alone until
  the hash is done with them, and `Loans` tells it when, region by region, so that it can read the next tensor into
  the start of its buffer while the hash still takes the end of the last one.

The hashes in progress belong to a `Hashes` session, which whoever records the digests owns (a conversion) and
hands to the readers it opens (`Reader.hashes`): a reader offers only to its own session, and one without a session
offers nothing. Within a session a hash is found by the file's identity (device, inode, size, modification time):
that is how a reader's offer finds it, and a second request for the same file takes it over rather than starting
again. Closing the session stops every hash still running; two sessions never see each other's hashes.
"""

from __future__ import annotations

import hashlib
import math
import os
import queue
import threading
from pathlib import Path
from typing import Callable

from gpt2port import inputs
from gpt2port.errors import GPT2PortError
from gpt2port.threads import start_thread

HASH_CHUNK = 16 << 20
OFFERED = 1 << 16  # pieces waiting for the hasher at most (views of a reader's buffer: they cost no memory)
POLL_S = 0.05  # how often a hasher waiting for offered pieces looks whether it was stopped or told to finish


def hash_file(path: Path, progress: Callable[[int], object] = lambda n: None, git: bool = False,
              stop: threading.Event | None = None) -> tuple[str, str | None]:
    """(sha256, git blob sha1 or None) of a file in one read; progress(bytes done) after each chunk. A set `stop`
    ends the read early and returns ("", None)."""
    size = os.stat(path).st_size
    sha256 = hashlib.sha256()
    blob = hashlib.sha1(b"blob %d\0" % size) if git else None
    done, buffer = 0, bytearray(HASH_CHUNK)  # one buffer for every chunk: a fresh one each read costs page faults
    with inputs.open_binary(path, buffering=0) as f:
        while n := f.readinto(buffer):
            if stop is not None and stop.is_set():
                return "", None
            chunk = memoryview(buffer)[:n]
            sha256.update(chunk)
            if blob is not None:
                blob.update(chunk)
            done += n
            progress(done)
    return sha256.hexdigest(), blob.hexdigest() if blob is not None else None


def _identity(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class FileHash:
    """The sha256 of one file, computed on a thread of its own from offered pieces and its own reads. `done(self)` is
    called once its digest was collected or it was cancelled (its session then forgets it)."""

    def __init__(self, path: Path, done: Callable[["FileHash"], object] = lambda h: None):
        self.path = Path(path)
        self._done = done
        st = os.stat(self.path)
        self.identity, self.size = _identity(st), st.st_size
        self.pos = 0  # bytes hashed so far, all of them from the file's start
        self._sha = hashlib.sha256()
        self._pieces: queue.Queue = queue.Queue(OFFERED)
        self._stop = threading.Event()
        self._lock = threading.Condition()
        self._open = True  # offers are taken until the hasher stops
        self._offered = self._taken = 0  # pieces queued, pieces the hasher is done with
        self._fed = False  # a reader has offered pieces of this file
        self._last = threading.Event()  # no more offers will come: what is left, the hasher reads itself
        self._digest: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"gpt2port-sha256-{self.path.name}", daemon=True)
        start_thread(self._thread, self.path)

    def offer(self, offset: int, data) -> int | None:
        """The file's bytes at `offset`, as a reader read them (any buffer); or, as an int, the count of bytes there
        that a reader read where it cannot lend them (the hasher reads those itself, now). Returns a ticket when the
        hasher took a buffer: the reader must not change those bytes before wait(ticket) returns (see Loans)."""
        self._fed = True  # a reader is at work on this file: from now on the hasher reads only what it must
        if offset + (data if isinstance(data, int) else len(data)) <= self.pos:  # already hashed: nothing to do
            return None
        with self._lock:
            if not self._open:
                return None
            try:
                self._pieces.put_nowait((offset, data))
            except queue.Full:  # the hasher is behind: it reads these itself when it gets there
                return None
            self._offered += 1
            return self._offered

    def wait(self, ticket: int) -> None:
        """Until the hasher is done with the piece offered under `ticket` (and every piece before it)."""
        with self._lock:
            while self._taken < ticket and self._open:
                self._lock.wait(POLL_S)

    def result(self) -> str:
        self._last.set()
        self._thread.join()
        self._done(self)
        if self._error is not None:
            raise GPT2PortError(f"{self.path}: hashing failed: {self._error}")
        if self._digest is None:
            raise GPT2PortError(f"{self.path}: hashing was cancelled")
        return self._digest

    def cancel(self) -> None:
        self._stop.set()
        self._thread.join()
        self._done(self)

    def _run(self) -> None:
        try:
            buffer = memoryview(bytearray(HASH_CHUNK))  # inside: no memory for it is the caller's error too
            with inputs.open_binary(self.path, buffering=0) as f:
                while self.pos < self.size and not self._stop.is_set():
                    waiting = self._fed and not self._last.is_set()
                    try:
                        offset, data = self._pieces.get(timeout=POLL_S) if waiting else self._pieces.get_nowait()
                    except queue.Empty:
                        if not waiting:
                            self._read(f.fileno(), buffer, self.pos + HASH_CHUNK)
                        continue
                    try:
                        if isinstance(data, int):  # bytes not lent: read them here
                            offset, data = offset + data, b""
                        while self.pos < offset:  # a gap before the offered piece: read it here
                            self._read(f.fileno(), buffer, offset)
                        if offset + len(data) > self.pos:
                            self._sha.update(memoryview(data)[self.pos - offset :])
                            self.pos = offset + len(data)
                    finally:
                        del data
                        with self._lock:
                            self._taken += 1
                            self._lock.notify_all()
            if self.pos >= self.size:
                self._digest = self._sha.hexdigest()
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread by result()
            self._error = e
        finally:  # no more offers are taken, and no reader waits for those queued
            with self._lock:
                self._open = False
                self._lock.notify_all()
            while True:
                try:
                    self._pieces.get_nowait()
                except queue.Empty:
                    break

    def _read(self, fd: int, buffer: memoryview, until: int) -> None:
        """Hash the file's bytes from self.pos up to `until` (or its end), read here."""
        want = min(until, self.size) - self.pos
        n = os.preadv(fd, [buffer[:want]], self.pos)
        if n == 0:
            raise OSError(f"ends at byte {self.pos}, {self.size} expected (truncated while read?)")
        self._sha.update(buffer[:n])
        self.pos += n


class Hashes:
    """The hashes of one conversion's source files: started here, offered the bytes its readers read, and all stopped
    by close() (a session is a context manager). Readers are handed it (Reader.hashes); nothing is shared between
    sessions, so two conversions in one process never take or stop each other's hashes."""

    def __init__(self):
        self._running: dict[tuple, FileHash] = {}  # identity -> a hash in progress (or finished, not yet collected)
        self._lock = threading.Lock()
        self._closed = False

    def start(self, path: Path) -> FileHash:
        """The hash of `path`: the one in progress in this session for this very file if there is one (taken over),
        else a new one."""
        key = _identity(os.stat(path))
        with self._lock:
            if self._closed:
                raise RuntimeError("a closed hashing session cannot start another hash")
            h = self._running.get(key)
            if h is None:
                h = self._running[key] = FileHash(Path(path), self._forget)
            return h

    def offer(self, fd: int, offset: int, data) -> tuple[FileHash, int] | None:
        """Readers call this with each piece of a file they read (fd open on it): free when this session is not
        hashing it. Where the hash took the piece, (hash, ticket): the bytes must stay as they are until
        hash.wait(ticket) (see Loans)."""
        if self._running:
            h = self._running.get(_identity(os.fstat(fd)))
            if h is not None:
                ticket = h.offer(offset, data)
                return (h, ticket) if ticket is not None else None
        return None

    def close(self) -> None:
        """Stop every hash still running (a failed conversion needs no digests: stop reading the source now)."""
        with self._lock:
            self._closed = True
            running = list(self._running.values())
        for h in running:
            h.cancel()

    def _forget(self, h: FileHash) -> None:
        with self._lock:
            if self._running.get(h.identity) is h:
                del self._running[h.identity]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Loans:
    """The pieces of one reader's reusable buffer on offer to hashes. Before it overwrites bytes [start, end) of the
    buffer, the reader calls reclaim(start, end), which waits only for the pieces lent from there: the hash may
    still be taking the rest of the last tensor while the next one is read into the buffer's start."""

    def __init__(self):
        self._lent: list[tuple[int, int, FileHash, int]] = []  # (buffer start, end, hash, ticket)

    def offer(self, hashes: Hashes, fd: int, offset: int, buffer_start: int, view) -> None:
        """Offer `view`, read from the file at `offset` into the buffer at `buffer_start`, to `hashes`."""
        taken = hashes.offer(fd, offset, view)
        if taken is not None:
            self._lent.append((buffer_start, buffer_start + len(view), *taken))

    def reclaim(self, start: int = 0, end: int | None = None) -> None:
        """Wait until no hash needs bytes [start, end) of the buffer any more (all of it by default)."""
        end = math.inf if end is None else end
        kept = []
        for lent in self._lent:
            lo, hi, h, ticket = lent
            if lo < end and hi > start:
                h.wait(ticket)
            else:
                kept.append(lent)
        self._lent = kept


class BackgroundHasher:
    """sha256 of each file (on threads of their own, in the session `hashes`, which stops them if the caller fails)
    while the caller works; `known` names files already hashed."""

    def __init__(self, files: list[Path], known: dict[str, str], hashes: Hashes):
        self._files = files
        self._known = known
        self._hashes: dict[Path, FileHash] = {}
        try:
            for f in files:
                if f.name not in known:
                    self._hashes[f] = hashes.start(f)
        except OSError as e:  # those started already stop with their session
            raise GPT2PortError(f"hashing the source failed: {e}") from None

    def results(self) -> list[dict]:
        digests = {f: h.result() for f, h in self._hashes.items()}
        return [{"name": f.name, "size": f.stat().st_size, "sha256": self._known.get(f.name) or digests[f]}
                for f in self._files]


class StreamHash:
    """The sha256 of a file's bytes as they are written, taken on a thread of its own in the order handed in, so
    that an output carries its fingerprint without being read back (records.py) and the writer does not wait for
    the hash: update() queues a piece and returns; then(), where given, runs once that piece is hashed (the writer
    hands its chunk on, to be written and reused, only then)."""

    def __init__(self, what):
        self._sha = hashlib.sha256()
        self._queue: queue.Queue = queue.Queue()
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gpt2port-sha256-out", daemon=True)
        start_thread(self._thread, what)

    def update(self, data, then: Callable[[], object] | None = None) -> None:
        self._queue.put((data, then))

    def hexdigest(self) -> str:
        """The digest of every piece handed in (waits for the last)."""
        self._finish()
        if self._error is not None:
            raise self._error
        return self._sha.hexdigest()

    def abort(self) -> None:
        """Stop hashing; the pieces still queued are handed on (then()) unhashed."""
        self._stopped = True
        self._finish()

    def _finish(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (got := self._queue.get()) is not None:
            data, then = got
            try:
                if not self._stopped and self._error is None:
                    self._sha.update(data)
            except BaseException as e:  # noqa: BLE001 - raised on the writer's thread by hexdigest()
                self._error = e
            finally:
                del data
                if then is not None:
                    then()
