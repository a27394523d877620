"""Writing outputs so that nothing is ever half-written under a final name.

A checkpoint directory is built under a temporary sibling name, every file flushed and fsynced, the weights
re-opened and checked, and only then renamed into place. The safetensors file itself is streamed: its header
is known up front (names, dtypes, shapes), so each tensor's bytes go to disk as soon as they are converted and
peak memory is one tensor, not the model.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import signal
import threading
from pathlib import Path

import torch

from gpt2port.errors import GPT2PortError
from gpt2port.safetensors_format import encode_header, read_header

WRITE_SLICE = 4 << 20
PARTIAL_MARK = ".partial-"  # temporary build directories: .<name>.partial-<pid>
OLD_MARK = ".replaced-"  # a checkpoint being replaced, kept until the new one is in place


class StreamingSafetensorsWriter:
    """Writes tensors declared in advance, in that order, one at a time. Use as a context manager; `close()`
    fsyncs and re-checks the file against the declaration."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]):
        self.path = Path(path)
        self.entries = entries
        self.metadata = metadata
        header, sizes = encode_header(entries, metadata)
        self._largest = max(sizes, default=0)
        self._staging: torch.Tensor | None = None
        self._next = 0
        self._file = open(self.path, "xb")
        self._flusher = _BackgroundFlusher(self._file.fileno())
        self._write(header)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected_name, dtype, shape = self.entries[self._next]
        if name != expected_name or tuple(tensor.shape) != tuple(shape):
            raise GPT2PortError(f"{self.path}: internal error: got {name} {tensor.dtype} {tuple(tensor.shape)}, "
                                f"declared {expected_name} {dtype} {tuple(shape)}")
        # Raw bytes, whatever the dtype (numpy has no bfloat16): reinterpret as uint8 without a copy.
        data = self._layout(tensor.detach().cpu(), dtype).reshape(-1).view(torch.uint8).numpy()
        self._write(data)
        self._next += 1

    def _layout(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The tensor as contiguous `dtype`: transpose and cast in one copy, into a staging buffer reused across
        tensors (a fresh allocation per tensor costs page faults on every byte)."""
        if tensor.dtype == dtype and tensor.is_contiguous():
            return tensor
        nbytes = tensor.numel() * dtype.itemsize
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(max(nbytes, self._largest), dtype=torch.uint8)
        staged = self._staging[:nbytes].view(dtype).view(tensor.shape)
        staged.copy_(tensor)
        return staged

    def _write(self, data) -> None:
        view = memoryview(data).cast("B")
        try:
            # In slices: one write() of a whole 300 MB tensor ran 2-4x slower here than the same bytes in 4 MB
            # writes (measured with the page cache warm, on ext4), as the kernel throttles the dirtying process.
            for start in range(0, len(view), WRITE_SLICE):
                self._file.write(view[start:start + WRITE_SLICE])
            self._flusher.wrote(len(view))
        except OSError as e:
            raise GPT2PortError(f"{self.path}: write failed: {_os_reason(e)}") from None

    def close(self) -> None:
        if self._next != len(self.entries):
            raise GPT2PortError(f"{self.path}: internal error: {len(self.entries) - self._next} tensors never written")
        try:
            self._file.flush()
            self._flusher.finish()
            os.fsync(self._file.fileno())
            self._file.close()  # on network filesystems a delayed write error can surface only here
        except OSError as e:
            _close_quietly(self._file)
            raise GPT2PortError(f"{self.path}: write failed: {_os_reason(e)}") from None
        check_written(self.path, self.entries, self.metadata)

    def abort(self) -> None:
        try:
            self._flusher.finish()
        except OSError:
            pass  # already failing; the file is about to be deleted
        _close_quietly(self._file)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *rest):
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _close_quietly(f) -> None:
    """Close a file whose failure is already being reported: on a full disk close() retries the buffered bytes and
    raises ENOSPC again, which would replace the one-line error naming the file with a bare OSError."""
    try:
        f.close()
    except OSError:
        pass


class _BackgroundFlusher:
    """fdatasync on a second thread every FLUSH_EVERY bytes, so the disk writes while we convert and the final
    fsync has little left to wait for. Errors surface at finish()."""

    FLUSH_EVERY = 256 << 20

    def __init__(self, fd: int):
        self._fd = fd
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
                self._thread.start()
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


def stream_safetensors(path: Path, items, metadata: dict[str, str], progress=None) -> None:
    """Write `items` [(name, dtype, shape, produce)] to `path`, calling each produce() only when its turn comes,
    so at most one tensor is in memory. progress(done_bytes, total_bytes) after each tensor."""
    total = sum(math.prod(shape) * dtype.itemsize for _, dtype, shape, _ in items)
    done = 0
    with StreamingSafetensorsWriter(path, [(n, d, s) for n, d, s, _ in items], metadata) as writer:
        for name, dtype, shape, produce in items:
            writer.write(name, produce())
            done += math.prod(shape) * dtype.itemsize
            if progress:
                progress(done, total)


def check_written(path: Path, entries, metadata: dict[str, str]) -> None:
    """Re-open a file just written and confirm its header says exactly what was declared."""
    header = read_header(path)
    got = [(e.name, e.dtype, tuple(e.shape)) for e in header.entries.values()]
    if got != [(n, d, tuple(s)) for n, d, s in entries] or header.metadata != metadata:
        raise GPT2PortError(f"{path}: post-write check failed: the file on disk does not match what was written")


def write_file(path: Path, data: bytes) -> None:
    """A small file (config, manifest), flushed to disk."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise GPT2PortError(f"{path}: write failed: {_os_reason(e)}") from None


def write_json(path: Path, obj) -> None:
    write_file(path, (json.dumps(obj, indent=2) + "\n").encode("utf-8"))


def copy_file(src: Path, dst: Path) -> None:
    try:
        shutil.copyfile(src, dst)
        with open(dst, "rb+") as f:
            os.fsync(f.fileno())
    except OSError as e:
        raise GPT2PortError(f"{dst}: copy from {src} failed: {_os_reason(e)}") from None


@contextlib.contextmanager
def staged_directory(dest: Path, force: bool = False):
    """Yield a temporary directory beside `dest`; on success it becomes `dest`, on any failure it vanishes.

    An existing non-empty `dest` is replaced only with force=True, and survives untouched until the new
    directory is complete: it is moved aside, the new one renamed in, and only then removed.
    """
    dest = Path(dest)
    if dest.is_symlink():
        # checkpoints/gpt2 -> /big/disk/gpt2: the checkpoint lives at the target, so build and replace it there
        # (renaming the link itself aside would leave the link behind as a leftover and the target orphaned).
        dest = Path(os.path.realpath(dest))
    parent = dest.parent
    created = _missing_parents(parent)  # removed again on failure: a failed run leaves no trace, not even those
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GPT2PortError(f"{parent}: cannot create output directory: {_os_reason(e)}") from None
    stage = parent / f".{dest.name}{PARTIAL_MARK}{os.getpid()}"
    try:
        sweep_leftovers(dest)
        if dest.exists() and not dest.is_dir():
            raise GPT2PortError(f"{dest}: exists and is not a directory")
        if dest.is_dir() and any(dest.iterdir()) and not force:
            raise GPT2PortError(f"{dest}: already exists (use --force to replace it)")
        try:
            stage.mkdir()  # exclusive: a stage of this name (another thread of ours) is never taken over
        except OSError as e:
            raise GPT2PortError(f"{parent}: cannot write here: {_os_reason(e)}") from None
    except BaseException:
        _remove_if_empty(created)
        raise
    try:
        yield stage
        _fsync_dir(stage)
        _swap_in(stage, dest, force)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        _remove_if_empty(created)
        raise


def _missing_parents(path: Path) -> list[Path]:
    """The directories that mkdir(parents=True) would create for `path`, innermost first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_if_empty(dirs: list[Path]) -> None:
    for d in dirs:
        try:
            d.rmdir()
        except OSError:  # not empty (someone else wrote there meanwhile) or already gone: leave it and its parents
            return


def _swap_in(stage: Path, dest: Path, force: bool) -> None:
    """Move the finished `stage` to `dest`. `dest` was checked at the start, but another run may have finished
    there since: without force its checkpoint stays. Renaming a directory onto a non-empty one fails, so even a
    checkpoint that lands between this check and the rename is never overwritten."""
    old = None
    with _signals_deferred():
        if dest.exists():
            if not force and dest.is_dir() and any(dest.iterdir()):
                raise GPT2PortError(f"{dest}: appeared while this run was writing (another run finished first?); "
                                    f"left as it is (use --force to replace it)")
            old = dest.parent / f".{dest.name}{OLD_MARK}{os.getpid()}"
            _rename(dest, old)
        try:
            os.rename(stage, dest)
        except OSError as e:
            if old is not None:
                try:
                    os.rename(old, dest)
                except OSError:  # another run's checkpoint took the name meanwhile; ours was to be replaced anyway
                    shutil.rmtree(old, ignore_errors=True)
            raise GPT2PortError(f"{dest}: could not move the new checkpoint into place ({_os_reason(e)}; another run "
                                f"may have written it meanwhile); nothing of this run was left") from None
        _fsync_dir(dest.parent)
        if old is not None:  # still deferred: a Ctrl-C during the renames must not leave the old copy behind
            shutil.rmtree(old, ignore_errors=True)


def _rename(src: Path, dst: Path) -> None:
    try:
        os.rename(src, dst)
    except OSError as e:
        raise GPT2PortError(f"{src}: cannot rename it to {dst}: {_os_reason(e)}") from None


def sweep_leftovers(dest: Path) -> list[Path]:
    """Remove build directories that a killed run left beside `dest` (their process is gone); restore a
    checkpoint that was moved aside if its replacement never arrived."""
    removed = []
    try:
        siblings = list(dest.parent.iterdir())
    except OSError:
        return removed
    for p in siblings:
        for mark in (PARTIAL_MARK, OLD_MARK):
            # Exact names only: a glob would let a destination called 'run*' take '.run1.replaced-N' for its own.
            prefix = f".{dest.name}{mark}"
            pid = p.name[len(prefix):]
            if p.name.startswith(prefix) and pid.isdigit() and not _pid_alive(pid):
                if mark == OLD_MARK and not dest.exists():
                    _rename(p, dest)
                else:
                    shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def _pid_alive(pid: str) -> bool:
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _signals_deferred():
    """Hold SIGINT/SIGTERM across the two renames so Ctrl-C cannot land between them."""
    caught = []
    handlers = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            handlers[sig] = signal.signal(sig, lambda s, f: caught.append(s))
    except ValueError:  # not the main thread: signals cannot be caught here anyway
        handlers = {}
    try:
        yield
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
        for sig in caught:
            os.kill(os.getpid(), sig)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _os_reason(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return "no space left on device"
    return e.strerror or str(e)
