"""What "never costs a user their data" means, as helpers shared by test_safety.py and test_faults.py: snapshots of
every byte under a path, leftover build directories, the CLI in-process and in a fresh process, and the checks that
a failure is one clean line and a checkpoint is complete."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from gpt2port.checkpoint import check_weights, read_config
from gpt2port.cli import main
from gpt2port.fsio import OLD_MARK, PARTIAL_MARK

WEIGHTS = "model.safetensors"
ROOT = Path(__file__).resolve().parents[1]  # the repository
FIXTURES = ROOT / "tests" / "fixtures"


def interruptible(**popen_kw) -> dict:
    """Popen keyword arguments for a child that a test stops with SIGINT: the child starts with SIGINT at its
    default, whatever this process inherited. A shell running pytest as a background job (`pytest &`) ignores
    SIGINT in it, and an ignored signal stays ignored across exec, so Python in the child would never raise
    KeyboardInterrupt and the test would wait for an interruption that cannot happen."""
    return {**popen_kw, "preexec_fn": _sigint_at_default}


def _sigint_at_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def snapshot(root: Path) -> dict:
    """Every entry under `root` -> (kind, size, mtime_ns, sha256): what 'unchanged' means, byte for byte."""
    root = Path(root)
    if not root.exists():
        return {}
    if not root.is_dir():
        return {".": _file_facts(root)}
    facts = {".": ("dir",)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            facts[str(p.relative_to(root))] = _file_facts(p)
    return facts


def _file_facts(p: Path) -> tuple:
    if p.is_symlink():
        return ("link", os.readlink(p))
    if p.is_dir():
        return ("dir",)
    st = p.stat()
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return ("file", st.st_size, st.st_mtime_ns, h.hexdigest())


def leftovers(parent: Path) -> list[str]:
    """Temporary build / moved-aside directories that a run left in `parent`."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    return sorted(p.name for p in parent.iterdir() if PARTIAL_MARK in p.name or OLD_MARK in p.name)


def run_cli(*args, env: dict | None = None):
    """The real click command, in-process. catch_exceptions=True: an escaping exception shows up as
    result.exception, which a clean failure never has (it exits through SystemExit)."""
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


PROGRESS_LINE = re.compile(r"^[\w-]+ \[(\s*\d+s|\d+/\d+)\] ")  # "verify [  3s] ...", "check [1/4] 0.1 s: ..."


def assert_one_line_error(exit_code: int, stderr: str, stdout: str = "", names=()) -> str:
    assert exit_code != 0, f"expected failure, got exit 0; stdout={stdout!r}"
    assert "Traceback" not in stderr + stdout, stderr
    # a log's progress lines ("verify [   3s] loading ...", see gpt2port.progress) are not part of the error
    lines = [ln for ln in stderr.strip().splitlines() if not PROGRESS_LINE.match(ln)]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{stderr}"
    line = lines[0]
    assert line.startswith("error: "), line
    for name in names:
        assert str(name) in line, f"{name!r} not named in: {line}"
    return line


def assert_clean_failure(result, names=()) -> str:
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"escaped {type(result.exception).__name__}: {result.exception}") from result.exception
    return assert_one_line_error(result.exit_code, result.stderr, result.stdout, names)


def run_module(*args, env: dict | None = None, cwd: Path | None = None, timeout: float = 120):
    """`python -m gpt2port ARGS` in a fresh process: what a user's terminal sees."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "gpt2port", *map(str, args)], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=timeout)


def assert_valid_checkpoint(ckpt: Path) -> None:
    """Complete and well-formed: header checked against config.json, manifest present, no temp files inside."""
    check_weights(ckpt / WEIGHTS, read_config(ckpt))
    assert (ckpt / "manifest.json").is_file()
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")]
