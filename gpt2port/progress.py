"""Progress bars and status lines that appear only on a terminal: logs and pipes get no bar garbage."""

from __future__ import annotations

import contextlib
import re
import sys
import threading
import time

from gpt2port.threads import start_thread


def show_bars(quiet: bool = False) -> bool:
    return not quiet and sys.stderr.isatty()


def tqdm_bar(quiet: bool = False, **tqdm_args):
    """A tqdm bar on stderr, or None where bars are not shown (quiet, a log, a pipe)."""
    if not show_bars(quiet):
        return None
    from tqdm import tqdm  # arrives with huggingface_hub

    return tqdm(**tqdm_args)


@contextlib.contextmanager
def byte_progress(label: str, quiet: bool = False):
    """Yield a callback(done_bytes, total_bytes) that drives one byte-count bar on stderr (or does nothing)."""
    if not show_bars(quiet):
        yield None
        return
    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm_bar(quiet, total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1000, leave=False)
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()


class StatusLine:
    """Progress of a long job on stderr. On a terminal: one self-overwriting line, "LABEL [elapsed s] message", with
    a bar when the message ends in a count ("block 3/12"); with `tick`, re-drawn every `tick` seconds so that a
    long step still shows time passing. Elsewhere (a log, a pipe, a notebook), when `lines`: one plain line per
    new step ("LABEL [elapsed s] message\n", counts thinned to one line per `every` seconds), and with `tick` the
    step again after `every` seconds without a line: a log never falls silent longer. Nothing when quiet.

    Call it with a message to show, or with None to clear the line (do that before printing anything else).
    """

    def __init__(self, label: str, quiet: bool = False, lines: bool = False, tick: float | None = None,
                 every: float = 10.0):
        self.label = label
        self.tty = show_bars(quiet)
        self.lines = lines and not quiet and not self.tty
        self.enabled = self.tty or self.lines
        self.shown = False
        self.t0 = time.perf_counter()
        self.message: str | None = None
        self.every = every
        self.last_step, self.last_line = None, -every
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.ticker = None
        if tick and self.enabled:
            self.ticker = threading.Thread(target=self._tick, args=(tick,), daemon=True, name="gpt2port-progress")
            start_thread(self.ticker, label)

    def __call__(self, message: str | None) -> None:
        if not self.enabled:
            return
        with self.lock:
            self.message = message
            if self.tty:
                self._draw()
            elif message is not None:
                self._line(message)
        if message is None and self.ticker is not None:
            self.stop.set()

    def _elapsed(self) -> str:
        return f"{self.label} [{time.perf_counter() - self.t0:5.0f}s]"

    def _draw(self) -> None:
        if self.message is None:
            if self.shown:
                sys.stderr.write("\r\033[K")
            self.shown = False
        else:
            sys.stderr.write(f"\r\033[K{self._elapsed()} {self.message}{_bar(self.message)}")
            self.shown = True
        sys.stderr.flush()

    def _line(self, message: str) -> None:
        step, now = _COUNT.sub("", message), time.perf_counter()
        if step == self.last_step and now - self.last_line < self.every:
            return
        self._write(message, step, now)

    def _write(self, message: str, step: str, now: float) -> None:
        self.last_step, self.last_line = step, now
        sys.stderr.write(f"{self._elapsed()} {message}\n")
        sys.stderr.flush()

    def _tick(self, period: float) -> None:
        while not self.stop.wait(period):
            with self.lock:
                now = time.perf_counter()
                if self.message is None:
                    continue
                if self.tty:
                    self._draw()
                elif now - self.last_line >= self.every:  # the same step, still running: say so
                    self._write(self.message, _COUNT.sub("", self.message), now)


def rate(done: int, total: int, t0: float, unit: str) -> str:
    """", 3.1 windows/s, 40 s left" for `done` of `total` since t0 (perf_counter), or "" before the first is done."""
    seconds = time.perf_counter() - t0
    if done <= 0 or seconds <= 0:
        return ""
    per_s = done / seconds
    return f", {per_s:.3g} {unit}/s, {(total - done) / per_s:.0f} s left"


_COUNT = re.compile(r"\d+")
_FRACTION = re.compile(r"(\d+)/(\d+)(?=,|$)")  # "block 3/12", "window 4/8, 2.1 windows/s, 2 s left"


def _bar(message: str, width: int = 20) -> str:
    m = _FRACTION.search(message)  # the first count: a rate after it is no count
    if not m or int(m.group(2)) <= 0:
        return ""
    filled = min(width, width * int(m.group(1)) // int(m.group(2)))
    return f" |{'#' * filled}{'.' * (width - filled)}|"
