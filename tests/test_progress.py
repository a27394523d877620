"""Long work says what it is doing: `verify` (the CLI, and gpt2port.verify(..., progress=True) in Python) draws a
self-overwriting line with a bar on a terminal and writes one plain line per step into a log or a pipe; and
transformers' deprecation warnings do not break those lines."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys

import pytest

from gpt2port import progress
from tests.support import ROOT



def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="default")


def test_verify_on_a_terminal_draws_a_line_with_a_bar_and_no_warning(tiny_ckpt):
    leader, follower = pty.openpty()
    try:
        p = subprocess.Popen([sys.executable, "-m", "gpt2port", "verify", str(tiny_ckpt), "--tokens", "16"],
                             stdout=subprocess.PIPE, stderr=follower, env=_env())
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal's other side closed: the process is done with it
                break
            if not chunk:
                break
            chunks.append(chunk)
        out = p.communicate(timeout=300)[0].decode()
    finally:
        os.close(leader)
    err = b"".join(chunks).decode(errors="replace")
    assert p.returncode == 0 and out.strip().splitlines()[-1].startswith("PASS"), out + err
    assert "\r\x1b[Kverify [" in err and "float64 reference: block 2/2 |####################|" in err, err
    assert "HF transformers: forward" in err
    assert "Warning" not in err and "deprecated" not in err, err
    assert err.endswith("\r\x1b[K")  # the line is cleared before the report is printed


def test_verify_from_python_with_progress_writes_plain_step_lines_into_a_log(tiny_ckpt, tmp_path):
    log = tmp_path / "log.txt"
    code = (f"import gpt2port; r = gpt2port.verify({str(tiny_ckpt)!r}, tokens=16, hf=False, progress=True); "
            "print(r.passed)")
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=f, text=True, timeout=300,
                           env=_env())
    err = log.read_text()
    assert r.returncode == 0 and r.stdout.strip() == "True", err
    lines = err.splitlines()
    assert "\r" not in err and "\x1b" not in err
    assert all(line.startswith("verify [") for line in lines), err
    steps = [line.split("] ", 1)[1] for line in lines]
    assert steps[0] == "loading the checkpoint and the reference"
    assert any(s.startswith("float64 reference: block") for s in steps)
    assert len(steps) < 40  # one line per step, counts thinned: not one per block of every forward


def test_status_lines_in_a_log_one_per_step_and_counts_thinned(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    say = progress.StatusLine("job", lines=True, every=3600)
    for i in range(1, 13):
        say(f"block {i}/12")
    say("HF: loading")
    say("HF: loading")
    say(None)
    assert [line.split("] ")[1] for line in err.getvalue().splitlines()] == ["block 1/12", "HF: loading"]
    quiet = progress.StatusLine("job", quiet=True, lines=True)
    quiet("anything")
    assert err.getvalue().count("\n") == 2
    assert progress.StatusLine("job").enabled is False  # without `lines` a log gets nothing, as before


def test_a_step_still_running_says_so_again_in_a_log(monkeypatch):
    import time

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    say = progress.StatusLine("job", lines=True, tick=0.02, every=0.1)
    say("block 1/4")
    time.sleep(0.5)
    say(None)
    lines = err.getvalue().splitlines()
    time.sleep(0.2)
    assert len(lines) >= 3 and all(line.endswith("block 1/4") for line in lines), lines
    assert err.getvalue().splitlines() == lines  # stopped with the step


def test_a_rate_and_what_is_left():
    import time

    assert progress.rate(0, 8, time.perf_counter(), "windows") == ""
    text = progress.rate(2, 8, time.perf_counter() - 1.0, "windows")
    assert text.startswith(", 2 windows/s, 3 s left") or text.startswith(", 1.99 windows/s, 3 s left"), text


@pytest.mark.parametrize("message, bar", [("block 0/4", " |....................|"),
                                          ("block 3/12", " |#####...............|"), ("loading", ""),
                                          ("window 2/4, 1.5 windows/s, 1 s left", " |##########..........|")])
def test_the_bar_follows_the_count(message, bar):
    assert progress._bar(message) == bar
