"""The one exception type gpt2port raises for bad input: its message is the one line the CLI prints."""

import sys


class GPT2PortError(Exception):
    """A user-facing failure. The message names the file, key or repo at fault and the cause."""


def did_you_mean(name: str, choices) -> str:
    """'; did you mean 'X'?' for the choice closest to a mistyped name (case aside), or '' when none is close."""
    import difflib

    folded = {str(c).lower(): str(c) for c in choices}
    close = difflib.get_close_matches(name.lower(), list(folded), n=1, cutoff=0.75)
    return f"; did you mean {folded[close[0]]!r}?" if close and folded[close[0]] != name else ""


def one_line(e: BaseException) -> str:
    """Any failure as the one line the CLI prints: an OSError with the paths it names, a message of several lines
    folded onto one."""
    if isinstance(e, OSError) and not isinstance(e, GPT2PortError):
        where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f)
        reason = e.strerror or str(e)
        return f"{where}: {reason}" if where else reason
    # A message that spans lines (torch's do) is folded onto one; spaces inside a line (a path's) stay as they are.
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return text or type(e).__name__


def allocation_failed(e: BaseException) -> bool:
    """Whether `e` is PyTorch refusing memory: torch.OutOfMemoryError (CUDA's allocator), or on the CPU a plain
    RuntimeError from c10's DefaultCPUAllocator, which has no exception type of its own: its message is the only
    mark there is. This is the one decision gpt2port takes on a message's text (tests/test_package.py forbids it in
    an except clause); a torch that rewords it only loses the out-of-memory line, for the generic one."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(e, getattr(torch, "OutOfMemoryError", ())):
        return True
    return type(e) is RuntimeError and "DefaultCPUAllocator: can't allocate memory" in str(e)

