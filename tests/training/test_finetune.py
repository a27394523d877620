"""gpt2port finetune: it learns, its result is an ordinary checkpoint that transformers agrees with, a stopped or
killed run resumes to the same numbers, torchrun with 2 processes (DDP and FSDP2) runs the same training as one,
and what it cannot do it refuses in one line with nothing written."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from gpt2port import GPT
from gpt2port.training import data as tokens
from tests.support import assert_clean_failure, assert_valid_checkpoint, interruptible, run_cli, snapshot
from tests.support import ROOT

LICENSE = Path("/usr/share/common-licenses/GPL-3")
# A short run: 8 sequences of 32 tokens per step, evaluated on 8 held-out windows every 5 steps.
RUN = ["--batch-size", "8", "--block-size", "32", "--lr", "1e-3", "--eval-every", "5", "--eval-windows", "8",
       "--quiet"]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """Real English text: a license the system ships, or (where it ships none) this project's README."""
    out = tmp_path_factory.mktemp("corpus") / "text.txt"
    shutil.copy(LICENSE if LICENSE.is_file() else ROOT / "README.md", out)
    return out


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]


def numbers(run: Path) -> list[tuple]:
    return [(r["step"], r.get("loss", r.get("eval_loss"))) for r in rows(run)]


def finetune_process(*args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gpt2port", "finetune", *map(str, args)], cwd=ROOT,
                            **interruptible(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw))


def wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    log = run / "train_log.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.is_file() and any(r.get("step", 0) >= step and "loss" in r for r in _safe_rows(log)):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"step {step} never logged")


def run_args(tiny_ckpt, corpus, out: Path) -> list:
    """The 20-step run every resume test compares with `straight`."""
    return [tiny_ckpt, "--data", corpus, "--out", out, "--steps", "20", "--save-every", "4", *RUN]


def stopped_run(args: list, out: Path, step: int, sig=signal.SIGINT) -> tuple[int, str]:
    """Start the run, send `sig` once step `step` is logged; (exit code, stderr)."""
    proc = finetune_process(*args)
    wait_for_step(out, step, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


# Imported by every Python process of the run (torchrun puts PYTHONPATH first on sys.path): a process that goes
# through interpreter shutdown leaves a file named after its rank.
SHUTDOWN_PROBE = """import atexit, os, pathlib
rank = os.environ.get("RANK")
if rank is not None:
    atexit.register(pathlib.Path(os.environ["GPT2PORT_TEST_PROBE"], "rank" + rank).touch)
"""


def torchrun(*args) -> None:
    """`torchrun --nproc-per-node 2 -m gpt2port finetune ARGS`, which must succeed, every rank leaving without the
    interpreter's shutdown: torch's gloo threads outlive the process group, and a rank shutting down beside them
    may die with SIGABRT (training.dist.exit_rank)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "gpt2port", "finetune", *args]
    with tempfile.TemporaryDirectory(prefix="torchrun-") as tmp:  # torchrun's own torchelastic_* directories
        probe = Path(tmp, "probe")
        probe.mkdir()
        (probe / "sitecustomize.py").write_text(SHUTDOWN_PROBE)
        path = os.pathsep.join([str(probe), *filter(None, [os.environ.get("PYTHONPATH")])])
        r = subprocess.run(list(map(str, cmd)), cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": tmp, "PYTHONPATH": path,
                                "GPT2PORT_TEST_PROBE": str(probe)})
        shut_down = sorted(f.name for f in probe.iterdir() if f.name.startswith("rank"))
    assert r.returncode == 0, r.stderr[-20000:]  # every rank's last lines, not only the launcher's
    assert shut_down == [], shut_down


def _safe_rows(log: Path) -> list[dict]:
    out = []
    for line in log.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


@pytest.fixture(scope="module")
def straight(tiny_ckpt, corpus, tmp_path_factory) -> Path:
    """An uninterrupted 20-step run, the reference for the resume and multi-process tests."""
    out = tmp_path_factory.mktemp("straight") / "run"
    r = run_cli("finetune", tiny_ckpt, "--data", corpus, "--out", out, "--steps", "20", "--save-every", "4", *RUN)
    assert r.exit_code == 0, r.output
    return out


def test_loss_falls_and_the_result_is_an_ordinary_checkpoint(straight, tiny_ckpt):
    log = rows(straight)
    evals = [r["eval_loss"] for r in log if "eval_loss" in r]
    train = [r for r in log if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 21))
    assert [r["step"] for r in log if "eval_loss" in r] == [0, 5, 10, 15, 20]
    assert evals[-1] < evals[0] - 0.3, evals  # held-out loss, not only the batches it trained on
    assert sum(r["loss"] for r in train[-5:]) / 5 < train[0]["loss"] - 0.3
    assert all(r["lr"] > 0 and r["tokens_per_s"] > 0 and r["grad_norm"] > 0 for r in train)
    assert train[0]["lr"] < train[1]["lr"]  # warmup, then the cosine brings it down to lr/10
    assert train[-1]["lr"] == pytest.approx(1e-4)
    assert_valid_checkpoint(straight)
    assert not (straight / "train_state").exists()  # the finished run needs no state
    chart = ET.parse(straight / "loss.svg").getroot()  # its content: tests/training/test_plot.py
    line = {p.get("class"): p.get("points").split() for p in chart.iter("{http://www.w3.org/2000/svg}polyline")}
    assert len(line["train"]) == 20 and len(line["eval"]) == 5
    manifest = json.loads((straight / "manifest.json").read_text())
    record = manifest["saves"][-1]
    assert record["from"] == str(Path(tiny_ckpt).resolve())
    assert record["finetune"]["settings"]["steps"] == 20 and record["finetune"]["final_eval_loss"] == evals[-1]
    tuned, parent = GPT.from_pretrained(straight), GPT.from_pretrained(tiny_ckpt)
    assert tuned.lm_head.weight is tuned.tok_emb.weight
    assert not torch.equal(tuned.blocks[0].attn.qkv.weight, parent.blocks[0].attn.qkv.weight)
    info = run_cli("info", straight)
    assert info.exit_code == 0 and f"fine-tuned  from {Path(tiny_ckpt).resolve()}" in info.stdout
    assert f"20 steps, eval loss {evals[-1]:.4f}" in info.stdout
    assert run_cli("generate", straight, "The", "--max-new-tokens", "4").exit_code == 0


def test_the_logged_eval_loss_is_what_transformers_computes_on_the_result(straight, corpus, tmp_path):
    """The number in the log is a real held-out loss: the exported model, run by transformers on the same
    windows, gives it again."""
    transformers = pytest.importorskip("transformers")
    assert run_cli("export", straight, "--to", "hf", "--out", tmp_path / "hf").exit_code == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    cache = tokens.prepare(corpus, straight, tmp_path / "tokens", block_size=32, quiet=True)
    x, y = tokens.windows(cache.val, tokens.eval_offsets(len(cache.val), 32, 8), 32)
    with torch.no_grad():
        logits = hf(x).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    assert float(loss) == pytest.approx(rows(straight)[-1]["eval_loss"], rel=1e-5)


@pytest.mark.rehearsal  # by default: test_a_resumed_run_keeps_its_settings (Ctrl-C, resume: the same numbers),
# test_a_killed_run_resumes_from_its_last_save (the same bytes)
def test_ctrl_c_then_resume_gives_the_uninterrupted_run(straight, tiny_ckpt, corpus, tmp_path):
    out = tmp_path / "run"
    args = run_args(tiny_ckpt, corpus, out)
    code, err = stopped_run(args, out, 6)
    assert code == 130, err
    assert "stopped after step" in err and "--resume" in err
    stopped_at = json.loads((out / "train_state" / "meta.json").read_text())["step"]
    assert 6 <= stopped_at < 20  # it finished the step it was in and saved there
    r = run_cli("finetune", *args, "--resume")
    assert r.exit_code == 0, r.output
    assert numbers(out) == numbers(straight)
    assert (out / "model.safetensors").read_bytes() == (straight / "model.safetensors").read_bytes()


@pytest.mark.rehearsal  # by default: the torchrun launcher's SIGTERM test below (stop, save, resume) and
# test_force.py's SIGTERM exit code 143 (cli.py's one mapping)
def test_sigterm_stops_the_run_as_ctrl_c_does_and_says_so_in_its_exit_code(tiny_ckpt, corpus, tmp_path):
    """A scheduler's SIGTERM: the step finishes, the state is saved, and the exit code is SIGTERM's (143)."""
    out = tmp_path / "run"
    code, err = stopped_run(run_args(tiny_ckpt, corpus, out), out, 3, signal.SIGTERM)
    assert code == 143, err
    assert "stopped after step" in err and "--resume" in err
    assert json.loads((out / "train_state" / "meta.json").read_text())["step"] >= 3


@pytest.mark.rehearsal  # by default: test_signals.py's test_a_stop_request_leaves_an_ignored_sigint_ignored (the
# loop's one mechanism, signals.stop_requests)
def test_an_ignored_sigint_leaves_the_run_alone(straight, tiny_ckpt, corpus, tmp_path):
    """Started with SIGINT ignored (nohup, `cmd &` in a script), the run ignores it: a Ctrl-C meant for the shell
    in front must not stop a background run."""
    out = tmp_path / "run"
    args = run_args(tiny_ckpt, corpus, out)
    proc = subprocess.Popen([sys.executable, "-m", "gpt2port", "finetune", *map(str, args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    wait_for_step(out, 4, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert numbers(out) == numbers(straight)


def test_a_killed_run_resumes_from_its_last_save(straight, tiny_ckpt, corpus, tmp_path):
    out = tmp_path / "run"
    args = run_args(tiny_ckpt, corpus, out)
    stopped_run(args, out, 10, signal.SIGKILL)  # no handler runs; the state saved at step 8 (or later) is left
    saved = json.loads((out / "train_state" / "meta.json").read_text())["step"]
    assert saved % 4 == 0 and saved >= 8
    r = run_cli("finetune", *args, "--resume")
    assert r.exit_code == 0, r.output
    assert numbers(out) == numbers(straight)  # the steps logged after the save were run (and logged) again
    assert (out / "model.safetensors").read_bytes() == (straight / "model.safetensors").read_bytes()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_torchrun_two_processes_train_as_one(mode, straight, tiny_ckpt, corpus, tmp_path):
    out = tmp_path / "run"
    torchrun(*run_args(tiny_ckpt, corpus, out), *(["--fsdp"] if mode == "fsdp" else []))
    one, two = numbers(straight), numbers(out)
    assert [s for s, _ in two] == [s for s, _ in one]  # rank 0 alone wrote the log: each row once
    for (_, a), (_, b) in zip(one, two):
        assert abs(a - b) <= 1e-4 * abs(a)
    # Weights: close, not equal: Adam divides by the gradient's running RMS, so where a gradient is near zero a
    # summation-order difference of 1e-7 moves that weight by up to a few 1e-5 over 20 steps at lr 1e-3.
    a, b = GPT.from_pretrained(straight).state_dict(), GPT.from_pretrained(out).state_dict()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-3, atol=1e-4)


def test_a_torchrun_run_stopped_by_its_launcher_stops_every_rank_at_one_step(straight, tiny_ckpt, corpus, tmp_path):
    """SIGTERM to torchrun (a scheduler's preemption): torchrun passes it on to each rank, every rank stops after
    the same step through the one mechanism (signals.stop_requests), the state is saved, and --resume on one process
    gives the uninterrupted run's numbers."""
    out = tmp_path / "run"
    args = run_args(tiny_ckpt, corpus, out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "gpt2port", "finetune", *map(str, args)]
    with tempfile.TemporaryDirectory(prefix="torchrun-") as tmp:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": tmp},
                                **interruptible(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        wait_for_step(out, 6, proc, timeout=300)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    assert "stopped after step" in err and "--resume" in err, err[-5000:]
    saved = json.loads((out / "train_state" / "meta.json").read_text())["step"]
    assert 6 <= saved < 20, err[-5000:]
    r = run_cli("finetune", *args, "--resume")
    assert r.exit_code == 0, r.output
    for (s1, a), (s2, b) in zip(numbers(straight), numbers(out), strict=True):
        assert s1 == s2 and abs(a - b) <= 1e-4 * abs(a)


def test_a_resumed_run_keeps_its_settings(straight, tiny_ckpt, corpus, tmp_path):
    out = tmp_path / "run"
    args = run_args(tiny_ckpt, corpus, out)
    stopped_run(args, out, 5)
    before = snapshot(out)
    r = run_cli("finetune", *args[:5], "--steps", "20", "--lr", "2e-3", "--resume")
    assert "--lr 0.002" in assert_clean_failure(r) and snapshot(out) == before
    # settings not named come from the saved run: the same numbers as the uninterrupted run
    r = run_cli("finetune", tiny_ckpt, "--data", corpus, "--out", out, "--resume", "--quiet")
    assert r.exit_code == 0, r.output
    assert numbers(out) == numbers(straight)


def _bad_data(tmp_path: Path, kind: str) -> Path:
    if kind == "empty file":
        (tmp_path / "empty.txt").write_text("")
        return tmp_path / "empty.txt"
    if kind == "binary file":
        (tmp_path / "blob.txt").write_bytes(bytes(range(256)) * 4)
        return tmp_path / "blob.txt"
    if kind == "directory without text":
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "x.bin").write_bytes(b"\0\1")
        return tmp_path / "d"
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["empty file", "binary file", "directory without text"])
def test_bad_data_is_refused_with_nothing_written(kind, tiny_ckpt, tmp_path):
    (tmp_path / "in").mkdir()
    data = _bad_data(tmp_path / "in", kind)
    before = snapshot(tmp_path)
    r = run_cli("finetune", tiny_ckpt, "--data", data, "--out", tmp_path / "run", *RUN)
    assert_clean_failure(r, names=[data])
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("extra, named", [
    (["--block-size", "65"], "--block-size 65"),  # the tiny model's context is 64
    (["--batch-size", "6", "--grad-accum", "4"], "--batch-size 6"),
    (["--resume"], "no training state"),
])
def test_impossible_settings_are_refused_with_nothing_written(extra, named, tiny_ckpt, corpus, tmp_path):
    before = snapshot(tmp_path)
    r = run_cli("finetune", tiny_ckpt, "--data", corpus, "--out", tmp_path / "run", *RUN, *extra)
    assert named in assert_clean_failure(r)
    assert snapshot(tmp_path) == before


def test_an_existing_run_is_not_overwritten_without_force(straight, tiny_ckpt, corpus):
    before = snapshot(straight)
    r = run_cli("finetune", tiny_ckpt, "--data", corpus, "--out", straight, "--steps", "2", *RUN)
    assert "--force" in assert_clean_failure(r, names=[straight])
    assert snapshot(straight) == before


def test_a_run_stopped_on_one_process_resumes_sharded_on_two(straight, tiny_ckpt, corpus, tmp_path):
    """The state is saved with torch.distributed.checkpoint: it reshards, so the world size may change."""
    out = tmp_path / "run"
    args = run_args(tiny_ckpt, corpus, out)
    assert stopped_run(args, out, 6)[0] == 130
    torchrun(*args, "--resume", "--fsdp")
    for (s1, a), (s2, b) in zip(numbers(straight), numbers(out), strict=True):
        assert s1 == s2 and abs(a - b) <= 1e-4 * abs(a)
