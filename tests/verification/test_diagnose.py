"""verify's diagnosis: each usual from-scratch mistake, made on purpose in gpt2port's own GPT (a mutant), is named
by verify_model with the stage it shows in, and confirmed by numbers (the error drops to the stage tolerance once
the reference makes the same mistake); an unknown fault is said to be unexplained; a correct model gets none.

The fixture model has a trained GPT-2's activation scales (tests/realistic.py): with random weights of std 0.02 an
exact GELU sits at the fp32 tolerance and attention is nearly uniform, as it is not in GPT-2 itself
(scripts/verify_sensitivity.py prints what verify sees at each scale)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gpt2port
from gpt2port import GPT
from scripts import hf_fixtures
from tests.conftest import TINY
from tests.realistic import realistic_hf_model


@pytest.fixture(scope="module")
def repo_and_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("diag")
    hf_fixtures.write_repo(realistic_hf_model(TINY, seed=21), root / "hf", "hub", "fp32", False)
    gpt2port.convert(root / "hf", root / "ckpt")
    return root / "hf", root / "ckpt"


class Mutant(nn.Module):
    """Attention computed by hand from the original's weights, with one mistake made on purpose."""

    def __init__(self, attn, scale=None, mask_shift=0, swap_qk=False):
        super().__init__()
        self.qkv, self.proj, self.n_head = attn.qkv, attn.proj, attn.n_head
        self.scale, self.mask_shift, self.swap_qk = scale, mask_shift, swap_qk

    def forward(self, x, cache=None, layer=0, pos=0):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        if self.swap_qk:
            q, k = k, q
        scale = self.scale if self.scale is not None else 1 / math.sqrt(C // self.n_head)
        att = (q @ k.transpose(-2, -1)) * scale
        keep = torch.tril(torch.ones(T, T, dtype=torch.bool), diagonal=self.mask_shift)
        att = F.softmax(att.masked_fill(~keep, float("-inf")), dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, C))


class UnbiasedLN(nn.Module):
    def __init__(self, ln):
        super().__init__()
        self.weight, self.bias, self.eps = ln.weight, ln.bias, ln.eps

    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        return (x - m) / torch.sqrt(x.var(-1, keepdim=True) + self.eps) * self.weight + self.bias  # unbiased: the bug


def erf_gelu(m):
    for b in m.blocks:
        b.mlp.act = F.gelu


def eps(m):
    m.blocks[1].ln1.eps = 1e-3


def unbiased(m):
    m.final_norm = UnbiasedLN(m.final_norm)


def attention(**mistake):
    def mutate(m):
        m.blocks[0].attn = Mutant(m.blocks[0].attn, **mistake)
    return mutate


def positions_from_one(m):
    m.embed = lambda idx, start_pos=0, pad=None: GPT.embed(m, idx, start_pos + 1, pad)


def dropout(m):
    m.train()
    for b in m.blocks:
        b.attn.resid_dropout.p = 0.2


CASES = {
    "erf GELU": (erf_gelu, "block 0: MLP", "exact (erf) GELU"),
    "LayerNorm eps": (eps, "block 1: attention", "LayerNorm eps 0.001"),
    "unbiased variance": (unbiased, "final LayerNorm", "unbiased variance"),
    "no 1/sqrt(d)": (attention(scale=1.0), "block 0: attention", "not divided by sqrt(head_dim)"),
    "mask sees the next": (attention(mask_shift=1), "block 0: attention", "also sees the next"),
    "mask misses itself": (attention(mask_shift=-1), "block 0: attention", "does not see itself"),
    "q/k swapped": (attention(swap_qk=True), "block 0: attention", "q and k swapped"),
    "positions from 1": (positions_from_one, "embeddings", "positions counted from 1"),
    "train mode": (dropout, "block 0: attention", "dropout active"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_mistake_is_named_and_measured(case, repo_and_ckpt):
    hf, ckpt = repo_and_ckpt
    mutate, where, named = CASES[case]
    model = GPT.from_pretrained(ckpt)
    mutate(model)
    rng = torch.random.get_rng_state()
    report = gpt2port.verify_model(model, hf, tokens=16, hf=False)
    assert not report.passed
    first = report.localization["first_divergence"]
    assert first.startswith(where), first
    d = report.localization["diagnosis"]
    assert d["explained_by"] and named in d["explained_by"], d
    assert d["rel_with"] <= d["tolerance"] < d["rel_before"]
    assert named in first and "fix:" in first
    assert "explained by" in report.to_text()
    if case == "train mode":
        assert model.training  # the model's mode and the caller's RNG are left as they were
    assert torch.equal(torch.random.get_rng_state(), rng) or case == "train mode"


def test_an_unknown_fault_is_unexplained(repo_and_ckpt):
    hf, ckpt = repo_and_ckpt
    model = GPT.from_pretrained(ckpt)
    with torch.no_grad():
        model.blocks[0].mlp.fc.weight.add_(torch.randn_like(model.blocks[0].mlp.fc.weight))
    report = gpt2port.verify_model(model, hf, tokens=16, hf=False)
    d = report.localization["diagnosis"]
    assert not report.passed and d["explained_by"] is None and d["closest"]
    assert "no known mistake explains it" in report.localization["first_divergence"]


def test_a_correct_model_gets_no_diagnosis(repo_and_ckpt):
    hf, ckpt = repo_and_ckpt
    report = gpt2port.verify_model(GPT.from_pretrained(ckpt), hf, tokens=16, hf=False)
    assert report.passed and report.localization["diagnosis"] is None


def test_a_users_class_is_diagnosed_through_its_own_modules(repo_and_ckpt):
    """nanoGPT's own class uses nn.GELU() (exact erf): verify names it, via hooks on the class's modules."""
    from gpt2port.config import GPTConfig
    from tests.userclasses import NANOGPT_ERF

    hf, ckpt = repo_and_ckpt
    model = NANOGPT_ERF.build(GPTConfig(**TINY))
    gpt2port.load_into(model, ckpt)
    report = gpt2port.verify_model(model, hf, tokens=16, hf=False)
    assert not report.passed
    assert "exact (erf) GELU" in report.localization["diagnosis"]["explained_by"]

