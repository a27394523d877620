"""load_into proves every load: what a class computes is judged on GPT-2's weights or on weights chosen to tell it
apart, never on the values the class was built with, and every load ends by measuring the class against GPT-2
(or refuses, naming the stage that differs). Classes in the published tutorials' style (tests/userclasses), on a
checkpoint with realistic activation scales at width 64 (tests/realistic.py)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from gpt2port import GPT, GPT2PortError, load_into
from gpt2port.checkpoint import load_state
from scripts.hf_fixtures import TINY
from tests.realistic import realistic_checkpoint
from tests.userclasses import Case, module
from tests.userclasses import seedstyle as seedstyle_class

NARROW = dict(TINY, n_embd=64)


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """(HF repo, gpt2port checkpoint, config) of a width-64 GPT-2 at realistic scales."""
    hf, ckpt = realistic_checkpoint(tmp_path_factory.mktemp("narrow"), NARROW, seed=3)
    return hf, ckpt, load_state(ckpt)[1]


def seedstyle(config, **options):
    return seedstyle_class.build(config.vocab_size, config.n_positions, config.n_layer, config.n_head, config.n_embd,
                                 **options)


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


# --- the activation, judged on weights that can tell ---------------------------------------------------------------

def test_relu_with_a_zero_initialised_mlp_output_is_refused(narrow):
    """Its starting MLP outputs are all zero, so every activation explains them equally: measured there, this class
    loaded as GELU and computed logits 12% off GPT-2's in silence."""
    _, ckpt, config = narrow
    model = seedstyle(config, act="relu", zero_proj=True)
    with pytest.raises(GPT2PortError, match=r"blocks\.0\.mlp: the activation .* measures as ReLU"):
        load_into(model, ckpt)


def test_nanochat_style_relu2_is_among_the_reasons(narrow):
    """nanochat zeroes its MLP output projection at init; ReLU² must still be named."""
    _, ckpt, config = narrow
    model = module("nanochat").build(config.vocab_size, 64, config.n_layer, config.n_head, config.n_embd)
    with torch.no_grad():
        for block in model.transformer.h:
            block.mlp.c_proj.weight.zero_()
    with pytest.raises(GPT2PortError) as err:
        load_into(model, ckpt)
    assert "measures as ReLU²" in str(err.value), str(err.value)


def test_erf_gelu_is_noted_at_width_64_for_kader_style(narrow):
    _, ckpt, config = narrow
    report = load_into(seedstyle(config), ckpt)  # the published class: F.gelu, the exact form
    assert any("exact (erf) GELU" in n for n in report.notes), report.notes


def test_erf_gelu_is_noted_at_width_64_for_gpt_mini_style(narrow):
    _, ckpt, config = narrow
    model = Case("gpt_mini").build(config)
    with torch.no_grad():
        for block in model.blocks:
            block.mlp.act = nn.GELU()  # the lesson's own nn.GELU(): exact erf
            nn.init.normal_(block.mlp.fc.weight, std=0.02)
            nn.init.normal_(block.mlp.proj.weight, std=0.02 / 2)
    report = load_into(model, ckpt, drop_biases=True)
    assert any("exact (erf) GELU" in n for n in report.notes), report.notes


def test_the_class_is_untouched_by_measuring_its_activation(narrow):
    _, ckpt, config = narrow
    model = seedstyle(config, act="relu")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(GPT2PortError):
        load_into(model, ckpt)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# --- every load ends with proof ------------------------------------------------------------------------------------

@pytest.mark.parametrize("source", ["ckpt", "hf"])
def test_every_load_reports_its_measured_agreement(narrow, source):
    hf, ckpt, config = narrow
    model = seedstyle(config, act="tanh")
    report = load_into(model, ckpt if source == "ckpt" else hf)
    p = report.proof
    assert p["passed"] and p["tokens"] == 16
    assert 0 <= p["rel"] <= 1e-5
    assert re.search(r"proof: logits equal GPT-2's to \S+ relative on 16 tokens", str(report)), str(report)
    idx = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert rel(model(idx), GPT.from_pretrained(ckpt)(idx)) <= 1e-5


def test_a_class_that_does_not_compute_gpt2_is_refused_naming_the_stage(narrow):
    """Unscaled attention scores hold every tensor in its place: only numbers show it, and only after loading."""
    _, ckpt, config = narrow
    with pytest.raises(GPT2PortError) as err:
        load_into(seedstyle(config, act="tanh", scale=False), ckpt)
    message = str(err.value)
    assert "does not compute GPT-2" in message
    assert "block 0: attention output differs" in message, message
    assert "not divided by sqrt(head_dim)" in message, message


def test_erf_gelu_proof_says_what_it_proves_and_what_it_costs(narrow):
    _, ckpt, config = narrow
    report = load_into(seedstyle(config), ckpt)
    assert report.proof["against"] == "GPT-2's with the exact (erf) GELU"
    assert report.proof["rel"] <= 1e-5
    assert 1e-5 < report.proof["gpt2_rel"] < 1e-1  # realistic scales: the two GELUs part visibly
    assert "against GPT-2's own tanh GELU they differ by" in report.proven


def test_dropped_biases_proof_is_against_gpt2_without_them(narrow):
    _, ckpt, config = narrow
    report = load_into(seedstyle(config, act="tanh", bias=False), ckpt, drop_biases=True)
    assert report.proof["against"] == "GPT-2's without the dropped biases"
    assert report.proof["rel"] <= 1e-5
    assert report.cost["max_rel"] > 1e-3  # what they cost against GPT-2 itself, measured apart
