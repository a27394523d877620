"""The "nothing lost" rules, once: outputs appear only when complete, sources are never written, files are hashed.

A checkpoint directory is built under a temporary sibling name, every file flushed and fsynced, the weights
re-opened and checked by their writer, and only then renamed into place. An existing output is replaced only on
request and survives until its replacement is complete. Every other module writes through these functions.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from gpt2port import inputs, records
from gpt2port.errors import GPT2PortError
from gpt2port.filekind import kind, real
from gpt2port.ownership import MANIFEST, OLD_MARK, PARTIAL_MARK, STAGE_MARK, check_replaceable, is_ours
from gpt2port.signals import deferred

__all__ = ["OLD_MARK", "PARTIAL_MARK", "STAGE_MARK", "check_replaceable"]  # the rule itself is ownership.py's

# The output this thread is building, and the scratch directories made inside it (see scratch_directory).
_STAGE: contextvars.ContextVar = contextvars.ContextVar("gpt2port_stage", default=None)


def write_file(path: Path, data: bytes) -> None:
    """A small file (config, manifest), flushed to disk, and recorded (records.py)."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise GPT2PortError(f"{path}: write failed: {os_reason(e)}") from None
    records.written(path, len(data), hashlib.sha256(data).hexdigest())


def write_json(path: Path, obj) -> None:
    write_file(path, (json.dumps(obj, indent=2) + "\n").encode("utf-8"))


def write_mark(path: Path, mark: dict, files: dict | None = None) -> None:
    """An output's mark (manifest.json, a token cache's meta.json) carrying the record of `files` (default: every
    file written so far into the output being built), sealed (records.py)."""
    write_json(path, records.sealed(mark, records.current() if files is None else files))


def refresh_mark(mark: Path, via: Path) -> None:
    """A sealed mark whose files this run has just moved (a rename moves a file's ctime, so its identity): their
    identities taken again, so that the next check need not read them; written at `via` (a name the output's rule
    claims), then renamed over the mark."""
    data = inputs.read_json(mark)
    files = records.files_of(data)
    if files is None:
        return
    for rel, rec in files.items():
        try:
            st = os.lstat(mark.parent / rel)
        except FileNotFoundError:
            continue
        if st.st_size == rec["size"]:
            rec["identity"] = records.identity(st)
    write_mark(via, data, files)
    os.replace(via, mark)


def copy_file(src: Path, dst: Path) -> None:
    """A small file (a tokenizer file) copied, flushed, and recorded by the hash of the bytes as they went out."""
    sha, size = hashlib.sha256(), 0
    try:
        with inputs.open_binary(src) as f, open(dst, "wb") as out:  # the source through the gate: no FIFO blocks
            while piece := f.read(1 << 20):
                sha.update(piece)
                out.write(piece)
                size += len(piece)
            out.flush()
            os.fsync(out.fileno())
    except OSError as e:
        raise GPT2PortError(f"{dst}: copy from {src} failed: {os_reason(e)}") from None
    records.written(dst, size, sha.hexdigest())


@contextlib.contextmanager
def staged_directory(dest: Path, force: bool = False, reads=()):
    """Yield a temporary directory beside `dest`; on success it becomes `dest`, on any failure it vanishes.

    An existing non-empty `dest` is replaced only with force=True and only if gpt2port wrote it (check_replaceable),
    and survives untouched until the new directory is complete: it is moved aside, the new one renamed in, and only
    then removed. reads: every file the run reads; none may lie in `dest` (refuse_replacing_reads).
    """
    dest = Path(dest)
    refuse_replacing_reads(dest, reads)
    if dest.is_symlink():
        # checkpoints/gpt2 -> /big/disk/gpt2: the checkpoint lives at the target, so build and replace it there
        # (renaming the link itself aside would leave the link behind as a leftover and the target orphaned).
        dest = real(dest)
    parent = dest.parent
    created = make_dirs(parent)  # removed again on failure: a failed run leaves no trace, not even those
    stage = parent / f".{dest.name}{PARTIAL_MARK}{os.getpid()}"
    try:
        sweep_leftovers(dest)
        what = kind(dest)
        if what not in (None, "directory"):
            raise GPT2PortError(f"{dest}: exists and is a {what}, not a directory")
        if what and any(dest.iterdir()):
            if not force:
                raise GPT2PortError(f"{dest}: already exists (use --force to replace it)")
            check_replaceable(dest)
        try:
            make_stage(stage)  # exclusive: a stage of this name (another thread of ours) is never taken over
        except OSError as e:
            raise GPT2PortError(f"{parent}: cannot write here: {os_reason(e)}") from None
    except BaseException:
        remove_if_empty(created)
        raise
    scratch: list[Path] = []
    token = _STAGE.set((stage, scratch))
    try:
        with records.recording(stage):
            yield stage
        for d in scratch:
            if d.exists():
                shutil.rmtree(d)
        _check_recorded(stage)
        os.unlink(stage / STAGE_MARK)  # the finished output carries its own marks
        _fsync_dir(stage)
        _swap_in(stage, dest, force)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        remove_if_empty(created)
        raise
    finally:
        _STAGE.reset(token)


def _check_recorded(stage: Path) -> None:
    """Every file of a finished output is in its manifest's record: a writer that went around fsio and outfile
    (and so left a file --force could never tell from a user's) fails here, before the output is put in place."""
    try:
        files = records.files_of(inputs.read_json(stage / MANIFEST)) or {}
    except GPT2PortError:
        files = {}
    missing = records.unrecorded(stage, files, skip={STAGE_MARK, MANIFEST})
    if missing or not files:
        raise RuntimeError(f"{stage}: written without a record ({', '.join(missing[:4]) or MANIFEST}): every "
                           f"output file goes through fsio or outfile, and the output's manifest records it")


def scratch_directory(prefix: str) -> Path:
    """A private directory for files made on the way (a tokenizer rebuilt from a GGUF): inside the output being
    built when there is one, so that even a killed run leaves it nowhere but there (and the next run sweeps it);
    removed before that output is moved into place. Outside one, a temporary directory: its maker removes it."""
    active = _STAGE.get()
    if active is None:
        return Path(tempfile.mkdtemp(prefix=prefix))
    stage, scratch = active
    scratch.append(Path(tempfile.mkdtemp(prefix=f".{prefix}", dir=stage)))
    return scratch[-1]


TEMP_MARK = ".gpt2port-temp"  # written first into a temporary directory: names it, for the sweep of a killed run's


def temp_directory(prefix: str) -> Path:
    """A private directory $TMPDIR/PREFIX-PID-XXXX for work that is no output (eval's conversion of a Hugging Face
    directory), marked; the ones a killed run of any command left there (its process gone) are swept first. Its
    maker removes it."""
    sweep_temp(prefix)
    made = Path(tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-"))
    write_file(made / TEMP_MARK, made.name.encode())
    return made


def sweep_temp(prefix: str) -> list[Path]:
    """Remove $TMPDIR/PREFIX-PID-* directories of processes that are gone: only real directories of this user that
    carry the mark naming them (a look-alike of someone else's stays)."""
    removed = []
    try:
        entries = list(Path(tempfile.gettempdir()).iterdir())
    except OSError:
        return removed
    for p in entries:
        pid = p.name[len(prefix) + 1:].split("-", 1)[0]
        if not (p.name.startswith(f"{prefix}-") and pid.isdigit()) or _pid_alive(pid):
            continue
        try:
            st, mark = p.lstat(), p / TEMP_MARK
            ours = kind(p) == "directory" and st.st_uid == os.getuid() and kind(mark) == "file" and \
                inputs.read_bytes(mark, len(p.name.encode()), "a temporary directory's mark") == p.name.encode()
        except (OSError, GPT2PortError):
            continue
        if ours:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def make_stage(stage: Path) -> None:
    """Create the build directory `stage` (exclusively: never one that exists) with gpt2port's mark written first
    into it: the next run sweeps a killed run's build directory only when it carries the mark naming it."""
    make_dirs(stage.parent)
    stage.mkdir()
    try:
        write_json(stage / STAGE_MARK, {"tool": "gpt2port", "stage": stage.name})
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def make_dirs(path: Path) -> list[Path]:
    """mkdir -p without recursion (pathlib's recurses once per missing level: 2,000 of them end in RecursionError).
    Returns the directories made, innermost first."""
    created = missing_parents(path)
    for d in reversed(created):
        try:
            d.mkdir(exist_ok=True)
        except OSError as e:
            remove_if_empty(created)
            raise GPT2PortError(f"{d}: cannot create output directory: {os_reason(e)}") from None
    return created


def missing_parents(path: Path) -> list[Path]:
    """The directories that mkdir(parents=True) would create for `path`, innermost first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def remove_if_empty(dirs: list[Path]) -> None:
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
    with deferred():  # SIGINT/SIGTERM held across the two renames, so Ctrl-C cannot land between them
        if dest.exists():
            if not force and dest.is_dir() and any(dest.iterdir()):
                raise GPT2PortError(f"{dest}: appeared while this run was writing (another run finished first?); "
                                    f"left as it is (use --force to replace it)")
            if dest.is_dir():
                check_replaceable(dest)  # checked at the start, but anyone may have written there since
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
            raise GPT2PortError(f"{dest}: could not move the new checkpoint into place ({os_reason(e)}; another run "
                                f"may have written it meanwhile); nothing of this run was left") from None
        _fsync_dir(dest.parent)
        if old is not None:  # still deferred: a Ctrl-C during the renames must not leave the old copy behind
            shutil.rmtree(old, ignore_errors=True)


def _rename(src: Path, dst: Path) -> None:
    try:
        os.rename(src, dst)
    except OSError as e:
        raise GPT2PortError(f"{src}: cannot rename it to {dst}: {os_reason(e)}") from None


def sweep_leftovers(dest: Path) -> list[Path]:
    """Remove build directories that a killed run left beside `dest` (their process is gone, and the whole
    directory is gpt2port's: ownership.is_ours); restore a checkpoint that was moved aside if its replacement never
    arrived."""
    removed = []
    try:
        siblings = list(dest.parent.iterdir())
    except OSError:
        return removed
    for p in siblings:
        for mark in (PARTIAL_MARK, OLD_MARK):
            # Exact names only: a glob would let a destination called 'run*' take '.run1.replaced-N' for its own.
            # Only what carries gpt2port's mark, checked through its whole tree: a user's look-alike stays.
            prefix = f".{dest.name}{mark}"
            pid = p.name[len(prefix):]
            if p.name.startswith(prefix) and pid.isdigit() and not _pid_alive(pid) and is_ours(p):
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))  # a directory, for its fsync: nothing read
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def os_reason(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return "no space left on device"
    return e.strerror or str(e)


# --- where things live -----------------------------------------------------------------------------------------

def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, found as huggingface_hub finds it (HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub), read when asked rather than at import."""
    cache = os.environ.get("HF_HUB_CACHE")
    if not cache:
        home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
        cache = os.path.join(home, "hub")
    return real(Path(cache).expanduser())


def is_inside(path: Path, other: Path) -> bool:
    """Whether `path` is `other` or lies under it (both resolved)."""
    path, other = real(path), real(other)
    return path == other or other in path.parents


def refuse_overlap(out: Path, source: Path, what: str = "the source") -> None:
    """An output must not be its source, inside it or around it: `--out checkpoints --force` would replace the
    directory that holds the source."""
    if is_inside(out, source) or is_inside(source, out):
        raise GPT2PortError(f"{out}: output must not be {what} or inside/around it ({source})")


def refuse_hf_cache(out: Path) -> None:
    cache = hf_cache_dir()
    if is_inside(out, cache):
        raise GPT2PortError(f"{out}: output must not be inside the Hugging Face cache ({cache})")


def refuse_replacing_reads(out: Path, reads) -> None:
    """An output must not be, nor hold, any file the run reads, by real path: a weights file reached through a
    symlink, or a TensorFlow `checkpoint` naming another directory, may live in the very directory --force would
    replace."""
    target = real(out)
    for f in reads:
        really = real(f)
        if really == target or target in really.parents:
            via = "" if really == Path(f).absolute() else f" (really {really})"
            raise GPT2PortError(f"{out}: output would replace {f}{via}, which this run reads; choose another --out")
