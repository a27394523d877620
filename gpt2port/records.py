"""The one record every output carries: each file gpt2port wrote into it, by content.

Every file gpt2port writes goes out through fsio (write_file, copy_file) or outfile (open_append); each takes the
file's sha256 while its bytes stream out (hashing.StreamHash for the large ones) and hands it here (`written`). The
output being built (`recording`: fsio.staged_directory, a token cache) collects them, and its mark lists them:

    "records": "gpt2port-records/1", "files": {path in the output: {"size", "sha256", "identity"}}, "seal": ...

The marks: a checkpoint's or an export's manifest.json (its weights, config, tokenizer files, a run's adapter/), a
token cache's meta.json, a fine-tuning run's train_log.record.json (its log, kept one line ahead, and its chart).
The seal is the sha256 of the mark's own JSON without the seal (sorted, compact): a mark edited by hand no longer
checks out. identity is (device, inode, size, mtime_ns, ctime_ns) as the file was when recorded: a file with the
same identity was not written since (a ctime cannot be set back), so `changed`, which the ownership rule asks about
each file before --force replaces it (ownership.py), re-hashes only a file whose identity moved (copied, renamed,
touched, written).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
from pathlib import Path

from gpt2port import inputs
from gpt2port.hashing import HASH_CHUNK, hash_file

FORMAT = "gpt2port-records/1"
TAG, FILES, SEAL = "records", "files", "seal"
RUN_RECORD = "train_log.record.json"  # a fine-tuning run's record of its own files (training/loop.py Log)
RUN_RECORD_NEW = f".{RUN_RECORD}.new"  # the next one, written whole, then renamed over it

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("gpt2port_record", default=None)
_KNOWN: dict[tuple, str] = {}  # identity now -> sha256: a file checked twice in one run (start, swap) is read once


def identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def entry(path: Path, size: int, sha256: str) -> dict:
    """A file's record, taken once it is written and closed."""
    return {"size": size, "sha256": sha256, "identity": identity(os.lstat(path))}


class Record:
    """The files written into the output at `root` so far: {path relative to root: entry}."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.files: dict[str, dict] = {}

    def add(self, path: Path, size: int, sha256: str) -> None:
        self.files[Path(path).relative_to(self.root).as_posix()] = entry(path, size, sha256)


@contextlib.contextmanager
def recording(root: Path):
    """Collect the record of every file written under `root` (the innermost output being built) until the end."""
    record = Record(root)
    token = _ACTIVE.set(record)
    try:
        yield record
    finally:
        _ACTIVE.reset(token)


def written(path, size: int, sha256: str) -> None:
    """A writer's report: `path` is closed, `size` bytes of this sha256. Recorded by the output being built when the
    path lies in it."""
    record = _ACTIVE.get()
    if record is not None and path is not None and Path(path).is_relative_to(record.root):
        record.add(Path(path), size, sha256)


def current() -> dict[str, dict]:
    """The files recorded so far by the output being built ({} outside one)."""
    record = _ACTIVE.get()
    return dict(record.files) if record is not None else {}


# --- marks -------------------------------------------------------------------------------------------------------

def sealed(mark: dict, files: dict[str, dict]) -> dict:
    """`mark` carrying `files` as its record, sealed."""
    body = {k: v for k, v in mark.items() if k not in (TAG, FILES, SEAL)}
    body.update({TAG: FORMAT, FILES: files})
    return {**body, SEAL: _seal_of(body)}


def _seal_of(body: dict) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def files_of(mark: dict) -> dict[str, dict] | None:
    """What a sealed mark records, {path: entry}; None when it is not one, or was changed since it was sealed."""
    if mark.get(TAG) != FORMAT or not isinstance(mark.get(FILES), dict):
        return None
    if mark.get(SEAL) != _seal_of({k: v for k, v in mark.items() if k != SEAL}):
        return None
    files = mark[FILES]
    if not all(isinstance(e, dict) and _whole(e.get("size")) and isinstance(e.get("sha256"), str)
               for e in files.values()):
        return None
    return files


def is_mark(mark: dict) -> bool:
    """Whether `mark` claims to be a record (sealed or not): one that does not check out was changed."""
    return TAG in mark


def recorded_size(mark: dict, name: str) -> int | None:
    """The size a mark records for `name`, in this version's record or an earlier one's ({name: size})."""
    got = mark.get(FILES, {}).get(name) if isinstance(mark.get(FILES), dict) else None
    got = got.get("size") if isinstance(got, dict) else got
    return got if _whole(got) else None


def _whole(n) -> bool:
    return type(n) is int and n >= 0


# --- checking a file against its record --------------------------------------------------------------------------

def changed(path: Path, rec: dict) -> str | None:
    """Why the regular file at `path` is no longer what `rec` records (its sizes, or that its bytes differ); None
    when it is. Read only when its identity moved since it was recorded. A log kept one line ahead (rec "before"
    and "pending": the record written before the line) is also its own when the line did not go out, or went out
    in part (a kill)."""
    st = os.lstat(path)
    if rec.get("identity") == identity(st):
        return None
    size = st.st_size
    if size == rec["size"] and _sha256(path, st) == rec["sha256"]:
        return None
    before, pending = rec.get("before"), rec.get("pending")
    if isinstance(before, dict) and isinstance(pending, str) and _whole(before.get("size")) and \
            before["size"] <= size < before["size"] + len(pending.encode("utf-8")) + 1:
        head, tail = _prefix(path, before["size"])
        if head == before.get("sha256") and pending.encode("utf-8").startswith(tail):
            return None
    if size != rec["size"]:
        return f"{size:,} bytes; gpt2port wrote {rec['size']:,}"
    return "changed since gpt2port wrote it: same size, other bytes"


def _sha256(path: Path, st: os.stat_result) -> str:
    key = tuple(identity(st))
    if key not in _KNOWN:
        _KNOWN[key] = hash_file(path)[0]
    return _KNOWN[key]


def _prefix(path: Path, n: int) -> tuple[str, bytes]:
    """(sha256 of the first n bytes, the bytes after them) of a small file (a log)."""
    h = hashlib.sha256()
    with inputs.open_binary(path) as f:
        left = n
        while left and (piece := f.read(min(left, HASH_CHUNK))):
            h.update(piece)
            left -= len(piece)
        return h.hexdigest(), f.read()


def unrecorded(root: Path, files: dict[str, dict], skip=()) -> list[str]:
    """The regular files under `root` (at every depth) that `files` does not record at their size, `skip` apart:
    what a writer put into an output around fsio and outfile."""
    out = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if rel not in skip and (rel not in files or files[rel]["size"] != os.lstat(path).st_size):
                out.append(rel)
    return sorted(out)


class RunRecord:
    """A fine-tuning run's record of its own files, sealed in RUN_RECORD beside them: its log, appended a line at a
    time and recorded one line ahead (the record names the log as it will be, as it is, and the line: a kill
    between the two leaves a log the record still describes), and the files it writes whole (its chart)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.files: dict[str, dict] = {}
        self._log: str | None = None
        self._sha, self._size = hashlib.sha256(), 0

    def start_log(self, path: Path, text: str):
        """Write the log afresh as `text` (the rows a resumed run keeps) and open it to append lines to."""
        self._log = Path(path).relative_to(self.out).as_posix()
        data = text.encode("utf-8")
        self._sha, self._size = hashlib.sha256(data), len(data)
        self.files[self._log] = {"size": self._size, "sha256": self._sha.hexdigest()}
        self._save()
        Path(path).write_bytes(data)
        return open(path, "a", encoding="utf-8", buffering=1)

    def append(self, line: str) -> None:
        """Record `line` as appended to the log: called just before it is written."""
        data = line.encode("utf-8")
        after = self._sha.copy()
        after.update(data)
        self.files[self._log] = {"size": self._size + len(data), "sha256": after.hexdigest(), "pending": line,
                                 "before": {"size": self._size, "sha256": self._sha.hexdigest()}}
        self._save()
        self._sha, self._size = after, self._size + len(data)

    def closed(self) -> None:
        """The log is closed as recorded: its identity taken, so that a check need not read it."""
        path = self.out / self._log
        if path.stat().st_size == self._size:
            self.files[self._log] = entry(path, self._size, self._sha.hexdigest())
            self._save()

    def add(self, files: dict[str, dict]) -> None:
        """Files of the run written whole (a Record's, rooted at the run)."""
        self.files.update(files)
        self._save()

    def _save(self) -> None:
        # Written whole beside it and renamed over it, not fsynced: a kill leaves the old record or the new one.
        text = json.dumps(sealed({}, self.files), indent=2) + "\n"
        new = self.out / RUN_RECORD_NEW
        new.write_text(text, encoding="utf-8")
        os.replace(new, self.out / RUN_RECORD)
