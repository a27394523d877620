"""Starting a thread, and the one line for memory refused: leaf helpers of the writers (outfile) and the hashers
(hashing), apart from both so that each may use the other without an import cycle."""

from __future__ import annotations

import threading

from gpt2port.errors import GPT2PortError


def start_thread(thread: threading.Thread, what) -> None:
    """thread.start(), refused in one line naming `what` (the file it works on) when the system starts no thread:
    Python's RuntimeError when there is no memory, or no address space under a `ulimit -v`, for its stack."""
    try:
        thread.start()
    except RuntimeError:
        raise out_of_memory(what, "cannot start a thread") from None


def out_of_memory(what, doing: str = "out of memory") -> GPT2PortError:
    """The one line for memory refused (ENOMEM, MemoryError, no thread), with the address-space limit if any."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    limit = "" if soft == resource.RLIM_INFINITY else f" (address space limited to {soft >> 20} MB: ulimit -v)"
    return GPT2PortError(f"{what}: {doing}: out of memory{limit}" if doing != "out of memory" else
                         f"{what}: out of memory{limit}")
