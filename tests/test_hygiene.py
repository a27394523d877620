"""What running the README's examples and the tests leaves behind: nothing git would list, nothing in the
system's temp directory."""

from __future__ import annotations

import os
import subprocess
import sys
from tests.support import ROOT



def test_what_the_readme_examples_write_is_ignored_by_git():
    outputs = ["checkpoints/gpt2", "checkpoints/gpt2-again", "runs/shakespeare/model.safetensors",
               "exports/gpt2-hf/config.json", "exports/gguf/gpt2/model.gguf", "report.json"]
    r = subprocess.run(["git", "check-ignore", "--no-index", *outputs], cwd=ROOT, capture_output=True, text=True)
    assert r.stdout.split() == outputs, r.stdout + r.stderr


def test_a_passing_test_run_leaves_nothing_in_the_temp_directory(tmp_path):
    """pytest keeps the directories of its last three runs by default: with the 124M fixtures that was GBs under
    /tmp after every run. The project's settings keep only a failing run's."""
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "test_t.py").write_text(
        "def test_writes(tmp_path, tmp_path_factory):\n"
        "    (tmp_path / 'big').write_bytes(b'x' * 1000)\n"
        "    (tmp_path_factory.mktemp('fixture') / 'w').write_bytes(b'y')\n")
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    config = str(ROOT / "pyproject.toml")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", config,
                        "--rootdir", str(tmp_path / "t"), str(tmp_path / "t" / "test_t.py")],
                       cwd=tmp_path / "t", capture_output=True, text=True, timeout=120,
                       env={**env, "TMPDIR": str(temp)})
    assert r.returncode == 0, r.stdout + r.stderr
    left = [str(p.relative_to(temp)) for p in temp.rglob("*") if p.is_file() or p.is_symlink()]
    assert left == [], left
