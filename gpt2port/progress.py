"""Progress bars and status lines that appear only on a terminal: logs and pipes get no bar garbage."""

from __future__ import annotations

import contextlib
import sys
import time


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
    """One self-overwriting status line on stderr, "LABEL [elapsed s] message", shown only when show_bars(quiet).

    Call it with a message to show, or with None to clear the line (do that before printing anything else).
    """

    def __init__(self, label: str, quiet: bool = False):
        self.label = label
        self.enabled = show_bars(quiet)
        self.shown = False
        self.t0 = time.perf_counter()

    def __call__(self, message: str | None) -> None:
        if not self.enabled:
            return
        if message is None:
            if self.shown:
                sys.stderr.write("\r\033[K")
            self.shown = False
        else:
            sys.stderr.write(f"\r\033[K{self.label} [{time.perf_counter() - self.t0:5.0f}s] {message}")
            self.shown = True
        sys.stderr.flush()
