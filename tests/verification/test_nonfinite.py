"""NaN or Inf weights: verify names the tensors (never blames the wiring or the references), and generate refuses
with one line after the text it streamed (never an internal error glued to it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpt2port import GPT, convert
from gpt2port.verification import verify_model
from tests.support import WEIGHTS, assert_one_line_error, run_cli, run_module

POISONED = "h.1.mlp.c_fc.weight"  # the HF name; gpt2port's model calls it blocks.1.mlp.fc.weight
OURS = "blocks.1.mlp.fc.weight"


def poison(repo: Path, out: Path, value: float) -> Path:
    shutil.copytree(repo, out)
    tensors = load_file(out / WEIGHTS)
    tensors[POISONED][3, 5] = value
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / WEIGHTS, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def nan_repo(tmp_path_factory, make_hf_repo) -> Path:
    return poison(make_hf_repo("hub"), tmp_path_factory.mktemp("nan") / "hf", float("nan"))


@pytest.fixture(scope="module")
def nan_ckpt(nan_repo) -> Path:
    out = nan_repo.parent / "ckpt"
    convert(nan_repo, out)
    return out


def test_verify_names_the_nan_weights_of_the_checkpoint(nan_ckpt):
    result = run_cli("verify", nan_ckpt, "--tokens", "8", "--no-hf", "-q")
    assert result.exit_code == 1, result.output
    verdict = result.stdout.strip().splitlines()[-1]
    assert verdict.startswith("FAIL: weights are finite: NaN or Inf in the model's weights: " + OURS), verdict
    assert "wires" not in result.stdout and "disagree" not in result.stdout


def test_verify_names_nan_in_the_reference(tiny_ckpt, nan_repo):
    """Clean weights checked against a reference whose file holds a NaN: the first differing stage is explained by
    the reference's own tensor (a NaN there used to vanish from the error, and every stage 'matched')."""
    result = run_cli("verify", tiny_ckpt, "--reference", nan_repo, "--tokens", "8", "--no-hf", "-q")
    assert result.exit_code == 1, result.output
    verdict = result.stdout.strip().splitlines()[-1]
    assert verdict.startswith("FAIL: block 1: MLP output differs"), verdict
    assert "NaN or Inf in the reference's weights: " + POISONED in verdict


def test_verify_model_names_an_inf_parameter(tiny_ckpt, make_hf_repo):
    model = GPT.from_pretrained(tiny_ckpt)
    with torch.no_grad():
        model.blocks[0].attn.proj.weight[1, 2] = float("inf")
    report = verify_model(model, make_hf_repo("hub"), tokens=8, hf=False)
    assert not report.passed
    assert report.failures[0].startswith("weights are finite: NaN or Inf in the model's weights: "
                                         "blocks.0.attn.proj.weight"), report.failures


@pytest.mark.parametrize("sampling", [["-t", "0"], ["--seed", "0"]], ids=["greedy", "sampled"])
def test_generate_refuses_nan_logits_on_a_line_of_its_own(nan_ckpt, sampling):
    proc = run_module("generate", nan_ckpt, "Hello", "-n", "5", *sampling)
    line = assert_one_line_error(proc.returncode, proc.stderr, proc.stdout, names=[nan_ckpt, OURS])
    assert "NaN or Inf" in line and "internal error" not in line
    assert proc.stdout == "Hello\n"  # the prompt, then the error's line starts afresh
