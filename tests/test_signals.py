"""Ctrl-C and SIGTERM at any moment of the `gpt2port` program's life: one line and exit 130 (143); once the work is
done, the command's own exit. Never SIGABRT, a traceback, an "internal error", or an interrupt lost.

The moments that went wrong: while the command line loads (a traceback), while torch's C++ start-up imports numpy
(the Ctrl-C swallowed as a failed optional import: the command ran on and exited 0; or numpy left half-loaded and a
later import failed as an "internal error"), elsewhere in torch's import (pybind11::error_already_set, SIGABRT),
and while the interpreter shuts down after the work ("Exception ignored ... KeyboardInterrupt")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpt2port.signals import Held, deferred, stop_requests
from tests.support import FIXTURES, ROOT

CKPT = FIXTURES / "v1-checkpoint"  # `info` on it loads torch and prints a table: a whole command, ~2 s
LAST_LINE = "total "  # of info's table: the output is complete

# The program as `python -m gpt2port` runs it (run with -m itself: `python -m` ends differently from `python -c`),
# with the signal sent at a chosen moment: "exit", from an atexit callback, during the interpreter's shut-down;
# "C:NAME", when the C function NAME first calls Python code (torch's C++ init functions import modules);
# "exec@MODULE", in code exec() runs from a string (dataclasses make their methods so) once MODULE is importing;
# anything else, when that module is looked up (numpy's lookup is made by torch's C++ start-up).
TRIPPED = textwrap.dedent("""
    import atexit, os, runpy, signal, sys
    where, sig = sys.argv[1], getattr(signal, sys.argv[2])
    def trip():
        sys.setprofile(None)
        os.kill(os.getpid(), sig)
    class Lookup:
        def find_spec(self, name, path=None, target=None):
            if name == where:
                sys.meta_path.remove(self)
                trip()
    calls = []  # the C functions running, each with the Python frame that called it
    def profile(frame, event, arg):
        if event == "c_call":
            calls.append((frame, getattr(arg, "__name__", "")))
        elif event in ("c_return", "c_exception") and calls and calls[-1][0] is frame:
            calls.pop()
        elif event == "call" and where.startswith("C:"):
            if calls and calls[-1][0] is frame.f_back and calls[-1][1] == where[2:]:
                trip()
        elif event == "call" and frame.f_code.co_filename == "<string>" and where[5:] in sys.modules:
            trip()
    if where == "exit":
        atexit.register(trip)
    elif where.startswith(("C:", "exec@")):
        sys.setprofile(profile)
    else:
        sys.meta_path.insert(0, Lookup())
    sys.argv = ["gpt2port", *sys.argv[3:]]
    runpy.run_module("gpt2port", run_name="__main__", alter_sys=True)
""")


def _as_a_terminal_gives_them(ignore_sigint: bool = False, own_group: bool = False):
    """preexec_fn: SIGINT and SIGTERM at their defaults whatever pytest was started with (a background job ignores
    SIGINT), or SIGINT ignored as nohup and `cmd &` leave it; optionally a process group of its own, as a shell
    gives a job (Ctrl-C goes to the whole group)."""
    def pre():
        signal.signal(signal.SIGINT, signal.SIG_IGN if ignore_sigint else signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if own_group:
            os.setpgid(0, 0)
    return pre


def _env(*more: Path) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *map(str, more), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture
def tripped(tmp_path):
    """tripped(where, sig) -> `gpt2port info` as `python -m` runs it, `sig` sent at the moment `where`."""
    (tmp_path / "tripped_gpt2port.py").write_text(TRIPPED)

    def run(where: str, sig: str, ignore_sigint: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tripped_gpt2port", where, sig, "info", str(CKPT)],
                              capture_output=True, text=True, timeout=120, cwd=ROOT, env=_env(tmp_path),
                              preexec_fn=_as_a_terminal_gives_them(ignore_sigint))
    return run


def assert_interrupted(rc: int, out: str, err: str, sig: int) -> None:
    assert rc == 128 + sig, (rc, err[-3000:])
    assert err.splitlines() == [f"error: {'interrupted' if sig == signal.SIGINT else 'terminated (SIGTERM)'}; "
                                f"no partial output was left"], err[-3000:]
    assert out == ""


def assert_completed(rc: int, out: str, err: str) -> None:
    assert rc == 0 and err == "", (rc, err[-3000:])
    assert out.splitlines()[-1].startswith(LAST_LINE), out[-500:]


@pytest.mark.parametrize("where, sig", [("click", "SIGINT"), ("click", "SIGTERM"), ("numpy", "SIGINT"),
                                        ("numpy", "SIGTERM"), ("numpy.dtypes", "SIGINT"), ("C:_c10d_init", "SIGINT"),
                                        ("C:_multiprocessing_init", "SIGTERM"), ("gpt2port.info", "SIGINT"),
                                        ("exec@gpt2port.info", "SIGINT")])
def test_an_interrupt_while_the_program_loads_ends_it_in_one_line(tripped, where, sig):
    """click: the command line loading, before the command's handlers (was: a traceback). Inside torch's C++
    start-up: numpy (the Ctrl-C was lost and the command ran to the end), numpy.dtypes (numpy was left half-loaded,
    and its next import failed as an internal error), C:... (the exception reached C++ that cannot pass it on:
    std::terminate, SIGABRT). gpt2port.info: the command's own modules, torch loaded. exec@: a dataclass being
    made (was: the line, then the process killed by SIGINT rather than exit 130)."""
    r = tripped(where, sig)
    assert_interrupted(r.returncode, r.stdout, r.stderr, getattr(signal, sig))


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_an_interrupt_while_the_interpreter_shuts_down_changes_nothing(tripped, sig):
    """The work is done and printed: the exit code stays the command's, and nothing is printed after it."""
    r = tripped("exit", sig)
    assert_completed(r.returncode, r.stdout, r.stderr)


def test_an_ignored_sigint_stays_ignored(tripped):
    """nohup and a shell's background job start the program with SIGINT ignored: holding signals must not turn
    that into a caught one."""
    r = tripped("numpy", "SIGINT", ignore_sigint=True)
    assert_completed(r.returncode, r.stdout, r.stderr)


def test_a_library_import_installs_no_handler():
    code = ("import signal, gpt2port, gpt2port.cli, gpt2port.__main__\n"
            "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, signal.getsignal(signal.SIGINT)\n"
            "assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, signal.getsignal(signal.SIGTERM)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=_env(), preexec_fn=_as_a_terminal_gives_them())
    assert r.returncode == 0, r.stderr


def _caught_sigterm(pid: int) -> bool:
    """The program has started (gpt2port.signals.program_start): SIGTERM is caught, which /proc shows."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # gone already
    mask = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def _run_signalled(delay: float | None, sig: int, group: bool) -> tuple[int, str, str, float]:
    """`python -m gpt2port info`, and `sig` `delay` seconds after it started its own code (None: never)."""
    proc = subprocess.Popen([sys.executable, "-m", "gpt2port", "info", str(CKPT)], cwd=ROOT, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_as_a_terminal_gives_them(own_group=group))
    try:
        deadline = time.monotonic() + 60
        while not _caught_sigterm(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.002)
        started = time.monotonic()
        if delay is not None:
            time.sleep(delay)
            try:
                os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
            except ProcessLookupError:
                pass
        out, err = proc.communicate(timeout=120)
        return proc.returncode, out, err, time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.rehearsal  # by default: test_an_interrupt_while_the_program_loads_ends_it_in_one_line, each point tripped
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc to see when the program started")
def test_an_interrupt_anywhere_in_a_command_ends_it_in_one_line_or_not_at_all():
    """A real SIGINT or SIGTERM, to the process or to its process group (a terminal's Ctrl-C), at delays spread
    over a whole `info` (mostly torch's import): interrupted in one line, or, when it came once the work was done,
    the complete output and exit 0. Never SIGABRT, a traceback or an internal error, whatever the delay."""
    rc, out, err, whole = _run_signalled(None, signal.SIGINT, False)
    assert_completed(rc, out, err)
    outcomes = []
    for i in range(8):
        sig = (signal.SIGINT, signal.SIGTERM)[i % 2]
        rc, out, err, _ = _run_signalled(whole * i / 7, sig, group=i % 3 == 0)
        outcomes.append(rc)
        assert rc != -signal.SIGABRT and "terminate called" not in err, err[-3000:]
        assert "Traceback" not in err and "internal error" not in err, err[-3000:]
        if rc == 0:
            assert_completed(rc, out, err)
        else:
            assert_interrupted(rc, out, err, sig)
    assert any(rc != 0 for rc in outcomes), outcomes  # some landed before the end


@pytest.fixture
def sigint_as_a_terminal_gives_it():
    """In this process: SIGINT raises KeyboardInterrupt, whatever pytest was started with."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_held_signals_are_acted_on_when_released(sigint_as_a_terminal_gives_it):
    held = Held()
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.01)  # delivered and recorded, not raised
    assert held.caught == [signal.SIGINT]
    with pytest.raises(KeyboardInterrupt):
        held.release()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    held.release()  # once only


def test_held_leaves_an_ignored_signal_ignored():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with deferred():
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    finally:
        signal.signal(signal.SIGINT, before)


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # delivered and handled before the next line


def test_a_stop_request_is_recorded_and_a_second_ctrl_c_raises(sigint_as_a_terminal_gives_it):
    """The training loop's requests (one mechanism with the program's holds): the first SIGINT and SIGTERM are
    read between steps; a second Ctrl-C raises at once; on leaving, the handlers are back and nothing is replayed."""
    term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(KeyboardInterrupt):
            with stop_requests() as stop:
                _deliver(signal.SIGTERM)
                _deliver(signal.SIGINT)
                assert stop.caught == [signal.SIGTERM, signal.SIGINT]
                _deliver(signal.SIGINT)
                pytest.fail("a second Ctrl-C did not interrupt")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        with stop_requests() as stop:
            _deliver(signal.SIGINT)
        assert stop.caught == []  # dropped: not replayed on leaving
    finally:
        signal.signal(signal.SIGTERM, term)


def test_a_stop_request_leaves_an_ignored_sigint_ignored():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with stop_requests() as stop:
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            _deliver(signal.SIGINT)
            _deliver(signal.SIGINT)
            assert stop.caught == []
    finally:
        signal.signal(signal.SIGINT, before)
