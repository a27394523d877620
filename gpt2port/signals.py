"""SIGTERM handled as Ctrl-C is: raised as an exception (Terminated, a KeyboardInterrupt) where the program is, so
every clean-up that Ctrl-C runs (a half-built output removed, a replaced one restored) runs for it too. Without
this, SIGTERM's default action ends the process on the spot and leaves its build directory behind."""

from __future__ import annotations

import contextlib
import signal

EXIT_TERMINATED = 128 + signal.SIGTERM  # what a shell reports for a process that SIGTERM ended


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt."""


def _terminate(signum, frame):
    raise Terminated()


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While inside, SIGTERM raises Terminated. A SIGTERM the caller made us ignore (nohup) stays ignored, and
    only the main thread may set handlers: elsewhere this does nothing."""
    try:
        previous = signal.getsignal(signal.SIGTERM)
        if previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _terminate)
    except ValueError:
        previous = None
    try:
        yield
    finally:
        if previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, previous)
