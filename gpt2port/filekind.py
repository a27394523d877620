"""What is at a path, by lstat/stat only, and where it really is (real).

A leaf module (it imports only errors), so that the gate (gpt2port/inputs.py) and the ownership rule can ask before
opening.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from gpt2port.errors import GPT2PortError

_KINDS = ((stat.S_ISREG, "file"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symbolic link"),
          (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"))


def kind(path: Path, follow: bool = False) -> str | None:
    """What is at `path` ("file", "directory", "symbolic link", "FIFO", ...), None if nothing."""
    try:
        mode = (os.stat if follow else os.lstat)(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        raise GPT2PortError(f"{path}: cannot look at it: {e.strerror or e}") from None
    return next((name for test, name in _KINDS if test(mode)), "special file")



def real(path) -> Path:
    """`path` absolute, every symbolic link followed; a path not there (yet) as far as it exists. A link loop is
    raised as the OSError (ELOOP) naming it: Path.resolve before Python 3.13 raised a RuntimeError for it instead."""
    try:
        return Path(os.path.realpath(path, strict=True))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise
        return Path(os.path.realpath(path))
