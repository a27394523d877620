"""The one gate every file a command reads passes through: weights, configs, tokenizer files, adapters, eval data,
training text, resume state.

Before anything is opened the path is looked at (lstat, then stat through links): a directory, FIFO, socket or
device, or a file of /proc or /sys (whose size says nothing of what reading it yields), is refused naming the path.
The file is then opened non-blocking (a FIFO swapped in after the look cannot hang the open) and looked at again
through its descriptor (fstat): only a regular file is read, and no more of it than its kind of input can need
(LIMITS); a bigger one is refused naming the file and the bound. JSON and JSON lines are parsed by the bounded
loader (gpt2port/jsonio.py), the refusal naming the file and the line.

A library that opens a file by its name (safetensors, numpy's memmap, torch.load) is given `checked(path)`: the same
look, so that tests/test_gate.py can tell such a call from one that goes around the gate.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gpt2port import jsonio
from gpt2port.errors import GPT2PortError
from gpt2port.filekind import kind, real

MB = 1 << 20
# What each kind of input can need, at most (bytes). Weights have no bound here: their readers check every length
# a file claims against its size (docs/safety.md, "Sizes a file claims"), and map rather than read them.
LIMITS = {
    "json": 64 * MB,  # a config, manifest, index, tokenizer.json (GPT-2's: 1.4 MB), adapter_config.json
    "tokenizer": 64 * MB,  # vocab.json, merges.txt, encoder.json, vocab.bpe (the largest, 1.0 MB)
    "eval data": 1024 * MB,  # --data of eval: HellaSwag's validation jsonl is 11 MB, WikiText-103's test 1.3 MB
    "prompts": 64 * MB,  # generate --prompts: a prompt a line
    "log": 256 * MB,  # a run's train_log.jsonl: a row per step is ~200 bytes
}
LINE_LIMIT = 16 * MB  # one line of a JSON-lines file (a HellaSwag row is ~1 KB)
_SYSTEM = ("/proc/", "/sys/")


def checked(path, what: str = "a regular file") -> Path:
    """`path` once it is known to be a regular file (through links) that is not in /proc or /sys; else one
    line naming it. what: the input's kind, in the refusal of a directory ("a JSON file")."""
    path = Path(path)
    found = kind(path, follow=True)
    if found is None:
        if kind(path) == "symbolic link":
            raise GPT2PortError(f"{path}: a symbolic link to nothing (its target is missing)")
        raise GPT2PortError(f"{path}: file not found")
    if found == "directory":
        raise GPT2PortError(f"{path}: is a directory, expected {what}")
    if found != "file":
        raise GPT2PortError(f"{path}: is a {found}, not a regular file; gpt2port does not open it")
    where = str(real(path)) + "/"
    if where.startswith(_SYSTEM):
        raise GPT2PortError(f"{path}: a file of /{where.split('/')[1]} (its size cannot be known: it says nothing of "
                            f"what reading yields); gpt2port does not read it")
    return path


def refuse_special(path) -> None:
    """Refuse, before opening, a path that is a FIFO, socket or device (through links); a directory or nothing at
    all is left to the caller to name (a source may be a directory)."""
    found = kind(Path(path), follow=True)
    if found not in (None, "file", "directory"):
        raise GPT2PortError(f"{path}: is a {found}, not a regular file; gpt2port does not open it")


def open_fd(path, limit: int | None = None, what: str = "a regular file") -> int:
    """A read-only descriptor of the regular file at `path` (the caller closes it), refused beyond `limit` bytes."""
    path = checked(path, what)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))  # OSError: its own
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced between the look and the open
            raise GPT2PortError(f"{path}: is no longer a regular file; gpt2port does not open it")
        if limit is not None and st.st_size > limit:
            raise GPT2PortError(f"{path}: {st.st_size:,} bytes, more than {what} can need ({limit:,}); gpt2port "
                                f"does not read it")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_binary(path, limit: int | None = None, what: str = "a regular file", buffering: int = -1):
    """The regular file at `path` opened for reading in binary ("rb"), through the checks of open_fd."""
    return os.fdopen(open_fd(path, limit, what), "rb", buffering)


def read_bytes(path, limit: int, what: str = "a regular file") -> bytes:
    """The whole file, at most `limit` bytes of it (one that grows past it while read is refused too)."""
    with open_binary(path, limit, what) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise GPT2PortError(f"{path}: more than {limit:,} bytes, more than {what} can need; gpt2port does not read "
                            f"it")
    return data


def read_text(path, limit: int, what: str = "a text file") -> str:
    """The file's UTF-8 text (refused naming the byte that is not)."""
    data = read_bytes(path, limit, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GPT2PortError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None


def read_json(path, what: type | None = dict, limit: int = LIMITS["json"]) -> object:
    """The JSON value of the file at `path`; refused unless it is a `what` (a JSON object by default; None: any)."""
    value = jsonio.loads(read_bytes(path, limit, "a JSON file"), path)
    if what is not None and not isinstance(value, what):
        raise GPT2PortError(f"{path}: expected a JSON {'object' if what is dict else what.__name__}")
    return value


def read_jsonl(path, limit: int, line_limit: int = LINE_LIMIT,
               what: str = "a JSON-lines file") -> list[tuple[int, dict]]:
    """(line number counted from 1, object) of every non-blank line of a JSON-lines file; a line that is not a JSON
    object, or longer than line_limit, is refused naming the file and the line."""
    rows = []
    for number, line in enumerate(read_bytes(path, limit, what).split(b"\n"), 1):
        if len(line) > line_limit:
            raise GPT2PortError(f"{path}: line {number}: {len(line):,} bytes long (a line is at most {line_limit:,})")
        if not line.strip():
            continue
        obj = jsonio.loads(line, f"{path}: line {number}", "not JSON")
        if not isinstance(obj, dict):
            raise GPT2PortError(f"{path}: line {number}: not a JSON object")
        rows.append((number, obj))
    return rows
