"""Gradient parity: on the same batch, gpt2port's GPT and transformers' GPT2LMHeadModel give the same loss and the
same gradient for every parameter (fp32; the tied embedding's is the sum of both of its uses), at tiny and 124M;
`verify --grads` reports it, and fails a model whose forward is right but whose backward is not."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn import functional as F

import gpt2port
from gpt2port import GPT
from gpt2port.verification.grads import TOLERANCE, gradient_parity
from tests.support import run_cli


def ids_of(T=33, seed=0):
    return torch.randint(0, 50257, (2, T), generator=torch.Generator().manual_seed(seed))


def test_gradients_equal_transformers_tiny(tiny_ckpt, make_hf_repo):
    g = gradient_parity(lambda: GPT.from_pretrained(tiny_ckpt), make_hf_repo("hub"), ids_of())
    assert g["loss_rel"] < 1e-6 and g["max_rel"] <= TOLERANCE, g
    assert g["params"] == 2 + 12 * 2 + 2  # wte (tied head once), wpe, 12 per block, final norm


@pytest.mark.heavy  # a second size of a check the default run makes on the tiny model
def test_gradients_equal_transformers_124m(gpt2_ckpt, gpt2_hf_repo):
    g = gradient_parity(lambda: GPT.from_pretrained(gpt2_ckpt), gpt2_hf_repo, ids_of(T=65, seed=1))
    assert g["loss_rel"] < 1e-6 and g["max_rel"] <= TOLERANCE, g


def test_verify_grads_in_the_report(tiny_ckpt):
    r = run_cli("verify", tiny_ckpt, "--grads", "--tokens", "16", "--no-hf", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    check = next(c for c in report["checks"] if c["name"] == "gradients vs transformers (fp32)")
    assert check["passed"] and report["metrics"]["grads"]["max_rel"] <= TOLERANCE


def test_a_wrong_backward_is_caught_though_the_logits_agree(tiny_ckpt, make_hf_repo):
    """The MLP's activation applied to a detached input: every logit as GPT-2's, the fc layers' gradients zero."""
    model = GPT.from_pretrained(tiny_ckpt)
    for b in model.blocks:
        b.mlp.act = lambda x: F.gelu(x.detach(), approximate="tanh") + (x - x.detach()) * 0
    report = gpt2port.verify_model(model, make_hf_repo("hub"), tokens=16, hf=False, grads=True)
    failed = [c.name for c in report.checks if not c.passed]
    assert failed == ["gradients vs transformers (fp32)"], report.to_text()
    g = report.metrics["grads"]
    assert g["max_rel"] > 0.5 and g["worst"].startswith("blocks."), g  # the MLP and all it feeds back into
    assert model.blocks[0].mlp.fc.weight.grad is None  # the caller's model is left as it was
