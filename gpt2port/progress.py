"""Progress bars that appear only on a terminal: logs and pipes get no bar garbage."""

from __future__ import annotations

import contextlib
import sys


def show_bars(quiet: bool = False) -> bool:
    return not quiet and sys.stderr.isatty()


@contextlib.contextmanager
def byte_progress(label: str, quiet: bool = False):
    """Yield a callback(done_bytes, total_bytes) that drives one byte-count bar on stderr (or does nothing)."""
    if not show_bars(quiet):
        yield None
        return
    from tqdm import tqdm  # arrives with huggingface_hub

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1000, leave=False)
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()
