"""Benchmarks: each measures gpt2port against a named baseline side by side in one run (`python -m scripts.bench.NAME
--help`). Their figures, method and history: docs/performance.md."""

import atexit
import shutil
import tempfile
from pathlib import Path


def scratch_root(prefix: str) -> Path:
    """A directory of this run's own for a benchmark given no --workdir, removed when the run ends (what it built and
    wrote there, checkpoints included, is not reused)."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root
