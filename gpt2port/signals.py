"""SIGINT and SIGTERM in gpt2port.

SIGTERM is handled as Ctrl-C is: raised as an exception (Terminated, a KeyboardInterrupt) where the program is, so
every clean-up that Ctrl-C runs (a half-built output removed, a replaced one restored) runs for it too. Without
this, SIGTERM's default action ends the process on the spot and leaves its build directory behind.

Both are held (recorded, not acted on) where an exception cannot be allowed to land. Importing torch is such a
place: its C++ start-up imports numpy and torch's own Python modules, and a KeyboardInterrupt raised in them either
reaches C++ that cannot pass it on (pybind11::error_already_set or torch's python_error, thrown where nothing
catches it: std::terminate, SIGABRT) or is taken for a failed optional import (the Ctrl-C lost, numpy left
half-loaded for the next import to fail on). So the `gpt2port` program holds them from its first line until the
command has loaded torch, then acts on what came, in Python code where the command's error handling sees it; and
holds them again once the work is done, while the interpreter shuts down. A library import (`import gpt2port`)
installs nothing.

The training loop asks for both as stop requests (stop_requests): held the same way, read by the loop between
steps, and a second signal of a kind acts at once. Under torchrun every rank is this same program: each holds its
own, and the loop's ranks agree to stop at the same step.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import signal
import threading

EXIT_TERMINATED = 128 + signal.SIGTERM  # what a shell reports for a process that SIGTERM ended
HELD = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt."""


class CtrlC(KeyboardInterrupt):
    """Ctrl-C in the program. Not KeyboardInterrupt itself: one of that exact class passing through code that exec()
    runs from a string (dataclasses and namedtuple make their methods so) marks it unhandled for good, and
    `python -m` then ends the process by SIGINT after it has reported the interruption and exited 130."""


def _terminate(signum, frame):
    raise Terminated()


def _interrupt(signum, frame):
    raise CtrlC()


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


class Held:
    """From creation until release(), SIGINT and SIGTERM are recorded instead of acted on. A signal the caller made
    us ignore (nohup, a background job) stays ignored; outside the main thread nothing is held (Python catches
    signals there only). A second signal of a kind, with `second="ends"`, takes its default action at once (the way
    out should what runs meanwhile hang); with `second="acts"`, goes to the handler that was in place (Ctrl-C then
    raises where the program is); else it is recorded too."""

    def __init__(self, second: str | None = None):
        self.caught: list[int] = []
        self.second = second
        self.previous: dict = {}
        try:
            for sig in HELD:
                if signal.getsignal(sig) not in (signal.SIG_IGN, None):  # None: a handler set outside Python
                    self.previous[sig] = signal.signal(sig, self._record)
        except ValueError:  # not the main thread
            pass

    def _record(self, signum, frame):
        if self.second and signum in self.caught:
            handler = self.previous.pop(signum) if self.second == "acts" else signal.SIG_DFL
            signal.signal(signum, handler)
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)
            return
        self.caught.append(signum)

    def release(self, act: bool = True) -> None:
        """Put the handlers back; with `act`, hand them what came, in order: a Python handler is called here, so
        its exception (KeyboardInterrupt, Terminated) is raised by this call; SIG_DFL's action is taken."""
        previous, self.previous = self.previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        caught, self.caught = self.caught, []
        for sig in caught if act else ():
            handler = signal.getsignal(sig)
            if callable(handler):
                handler(sig, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(sig)


@contextlib.contextmanager
def stop_requests():
    """SIGINT and SIGTERM recorded as requests to stop (`held.caught`, in order), for a loop to act on where it is
    safe (between steps); a second of a kind acts at once (Ctrl-C raises). Left: the handlers put back, and a
    request the loop did not act on (the work ended first) dropped."""
    held = Held(second="acts")
    try:
        yield held
    finally:
        held.release(act=False)


@contextlib.contextmanager
def deferred():
    """SIGINT and SIGTERM held while inside, and acted on when it is left."""
    held = Held()
    try:
        yield
    finally:
        held.release()


# The `gpt2port` program's state: "on" once started; its holds, "startup" until torch is loaded, "exit" once done.
_program: dict = {}


def program_start() -> None:
    """The `gpt2port` program's first act (gpt2port.__main__; never a library import's): SIGTERM as Ctrl-C for the
    whole run (Ctrl-C as CtrlC), and both held until the command loads torch (load_heavy)."""
    if _program:
        return
    if threading.current_thread() is not threading.main_thread():  # nothing to hold
        return
    # Held first, then our handlers put under it as the ones it hands back: a signal between two installs would
    # otherwise raise out of this function, before anything can report it.
    startup = Held(second="ends")
    ours = {signal.SIGTERM: (signal.SIG_DFL, _terminate), signal.SIGINT: (signal.default_int_handler, _interrupt)}
    for sig, (theirs, handler) in ours.items():
        if startup.previous.get(sig) is theirs or startup.previous.get(sig) == theirs:
            startup.previous[sig] = handler
    _program.update(on=True, startup=startup)
    atexit.register(_ignore_from_now)  # the first registered, so the last to run


def _ignore_from_now() -> None:
    """After the last exit callback: the interpreter then puts every handler it set back to SIG_DFL (a signal would
    end the process, its output complete, as killed by it) but leaves an ignored signal ignored."""
    for sig in _program["exit"].previous if "exit" in _program else ():
        signal.signal(sig, signal.SIG_IGN)


def load_heavy(*modules: str) -> None:
    """Import `modules` with SIGINT and SIGTERM held (the program's start-up hold, else one of its own), then act on
    what came meanwhile: raised here, where the caller's except clauses see it."""
    held = _program.pop("startup", None) or Held(second="ends")
    try:
        for name in modules:
            if held.caught:  # interrupted already: say so now, not after a long import
                break
            importlib.import_module(name)
    finally:
        held.release()


@contextlib.contextmanager
def command(*heavy: str):
    """One command of the program: `heavy` loaded first (load_heavy), then the command; once it is over, however it
    ended, the program's exit hold (program_end)."""
    try:
        load_heavy(*heavy)
        yield
    finally:
        program_end()


def program_end() -> None:
    """The work is done (or failed) and the program exits with its result: from here a signal is recorded and
    dropped, so a Ctrl-C changes neither the exit code nor makes a traceback out of the interpreter's shut-down; a
    second one ends the process at once, should the exit hang. Does nothing outside the program."""
    if not _program or "exit" in _program:  # not the program, or already ending
        return
    startup = _program.pop("startup", None)
    if startup is not None:  # --help, a usage error: no command ran
        startup.release(act=False)
    _program["exit"] = Held(second="ends")
