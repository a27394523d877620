"""finetune's numbers and data (issue 38, finding 6): every number option finite and in range, refused in one line
naming it before anything is written; a run whose loss or weights stop being finite ends with a refusal, its last
saved state kept and no checkpoint written; --data refused by what it is (a model directory, whitespace of any size,
a FIFO, a device, a /proc file), never opened in a way that blocks."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from gpt2port.errors import GPT2PortError
from gpt2port.training import finetune as ft
from gpt2port.training import loop
from tests.support import ROOT, assert_clean_failure, assert_one_line_error, run_cli, run_module, snapshot

LICENSE = Path("/usr/share/common-licenses/GPL-3")
RUN = ["--batch-size", "8", "--block-size", "32", "--eval-every", "0", "--eval-windows", "4", "--quiet"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus") / "text.txt"
    shutil.copy(LICENSE if LICENSE.is_file() else ROOT / "README.md", out)
    return out


@pytest.mark.parametrize("option, value", [
    ("--lr", "inf"), ("--lr", "nan"), ("--lr", "-inf"), ("--lr", "2"), ("--min-lr", "nan"), ("--min-lr", "1"),
    ("--weight-decay", "nan"), ("--weight-decay", "inf"), ("--weight-decay", "-0.1"), ("--clip", "inf"),
    ("--clip", "nan"), ("--dropout", "nan"), ("--val-fraction", "inf"), ("--seed", "-1"), ("--seed", str(2**70)),
    ("--steps", "0"), ("--batch-size", "0"), ("--batch-size", str(2**40)), ("--block-size", "0"),
    ("--warmup", "-1"), ("--warmup", "50"), ("--grad-accum", "0"), ("--eval-every", "-1"), ("--save-every", "-2"),
    ("--eval-windows", "0"),
])
def test_a_number_out_of_range_is_refused_naming_it_with_nothing_written(option, value, tiny_ckpt, corpus,
                                                                         tmp_path):
    before = snapshot(tmp_path)
    r = run_cli("finetune", tiny_ckpt, "--data", corpus, "--out", tmp_path / "run", "--steps", "10", *RUN,
                option, value)
    line = assert_clean_failure(r)
    assert line.startswith(f"error: {option} ") and "internal error" not in line, line
    assert snapshot(tmp_path) == before


def test_the_python_call_checks_the_same_ranges(tiny_ckpt, corpus, tmp_path):
    with pytest.raises(GPT2PortError, match="--min-lr nan: must be a finite number"):
        ft.finetune(tiny_ckpt, corpus, tmp_path / "run", ft.Settings(steps=4, min_lr=float("nan")), quiet=True)
    with pytest.raises(GPT2PortError, match="--steps 2.5: must be a whole number"):
        ft.finetune(tiny_ckpt, corpus, tmp_path / "run", ft.Settings(steps=2.5), quiet=True)
    assert not (tmp_path / "run").exists()


def test_a_diverging_run_writes_no_checkpoint_and_keeps_its_last_state(tiny_ckpt, corpus, tmp_path, monkeypatch):
    """From step 3 on the learning rate is 1e30 (finite, as a diverging run's numbers are): the weights reach 1e30,
    the next forward overflows to NaN. The run stops there, with the state saved at step 2 as it was; --resume
    continues from it to an ordinary, finite checkpoint."""
    real = loop.lr_at
    monkeypatch.setattr(loop, "lr_at", lambda step, **kw: 1e30 if step >= 2 else real(step, **kw))
    out = tmp_path / "run"
    args = [tiny_ckpt, "--data", corpus, "--out", out, "--steps", "6", "--save-every", "2", "--warmup", "0", *RUN]
    line = assert_clean_failure(run_cli("finetune", *args), names=[out])
    assert "diverged at step 4" in line and "saved at step 2 is kept" in line, line
    assert json.loads((out / "train_state" / "meta.json").read_text())["step"] == 2
    assert not (out / "model.safetensors").exists()
    assert [r["step"] for r in map(json.loads, (out / "train_log.jsonl").read_text().splitlines())] == [1, 2, 3]
    monkeypatch.setattr(loop, "lr_at", real)
    r = run_cli("finetune", *args, "--resume")
    assert r.exit_code == 0, r.output
    from gpt2port import GPT

    import torch
    assert all(bool(torch.isfinite(p).all()) for p in GPT.from_pretrained(out).parameters())


def _data(kind: str, tmp_path: Path, tiny_ckpt: Path) -> Path:
    if kind == "checkpoint directory":
        return tiny_ckpt
    if kind == "its merges.txt":
        return tiny_ckpt / "merges.txt"
    if kind == "300 KB of whitespace":
        (tmp_path / "ws.txt").write_text(" \n\t\r\n" * 60_000)
        return tmp_path / "ws.txt"
    if kind == "a directory with a FIFO .txt":
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "a.txt").write_text("Some text to train on.\n" * 200)
        os.mkfifo(tmp_path / "d" / "b.txt")
        return tmp_path / "d"
    return Path(kind)


@pytest.mark.parametrize("kind, says", [
    ("checkpoint directory", "a model directory"),
    ("its merges.txt", "tokenizer file"),
    ("300 KB of whitespace", "only whitespace"),
    ("a directory with a FIFO .txt", "a FIFO"),
    ("/dev/zero", "a character device"),
    ("/dev/urandom", "a character device"),
    ("/proc/self/status", "its size cannot be known"),
])
def test_data_of_the_wrong_kind_is_refused_for_what_it_is(kind, says, tiny_ckpt, tmp_path):
    (tmp_path / "in").mkdir()
    data = _data(kind, tmp_path / "in", tiny_ckpt)
    if not data.exists():
        pytest.skip(f"{data} does not exist here")
    (tmp_path / "out").mkdir()  # apart from the data: a snapshot reads every file, and a FIFO's read would block
    r = run_cli("finetune", tiny_ckpt, "--data", data, "--out", tmp_path / "out" / "run", "--steps", "2", *RUN)
    line = assert_clean_failure(r)
    assert says in line and "empty" not in line, line
    assert list((tmp_path / "out").iterdir()) == []


def test_a_fifo_is_refused_without_opening_it(tiny_ckpt, tmp_path):
    """Opening a FIFO for reading blocks until a writer comes: a fresh process with a time limit shows it never
    does."""
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    r = run_module("finetune", tiny_ckpt, "--data", fifo, "--out", tmp_path / "run", "--steps", "2", *RUN,
                   timeout=120)
    line = assert_one_line_error(r.returncode, r.stderr, r.stdout, names=[fifo])
    assert "a FIFO" in line and "empty" not in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("alpha", ["inf", "nan"])
def test_lora_alpha_not_finite_is_refused_naming_the_option(alpha, tiny_ckpt, corpus, tmp_path):
    r = run_cli("finetune", tiny_ckpt, "--data", corpus, "--out", tmp_path / "run", "--steps", "4", *RUN,
                "--lora", "2", "--lora-alpha", alpha)
    line = assert_clean_failure(r, names=[f"--lora-alpha {alpha}"])
    assert "finite" in line and not (tmp_path / "run").exists()


def test_a_divergence_a_huge_lora_alpha_causes_names_it_not_lr(tiny_ckpt, corpus, tmp_path):
    """alpha 1e30 at rank 2 (finite, accepted) scales the adapters by 5e29: once B moves, the logits overflow."""
    r = run_cli("finetune", tiny_ckpt, "--data", corpus, "--out", tmp_path / "run", "--steps", "6", *RUN,
                "--lora", "2", "--lora-alpha", "1e30")
    line = assert_clean_failure(r)
    assert "diverged" in line and "--lora-alpha 1e+30" in line and "--lr" not in line, line
