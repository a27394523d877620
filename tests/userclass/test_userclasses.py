"""The users' own GPT classes (tests/userclasses) are right: each one, filled by the loader a learner would write by
hand, computes GPT-2. Hand-loaded, the faithful classes give gpt2port's logits to 1e-5; nanoGPT's erf GELU is the
only thing between it and GPT-2; a biasless class computes GPT-2 with exactly the biases it lacks set to zero. That
makes hand_load an oracle for any generic loader."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from gpt2port import GPT
from gpt2port.checkpoint import load_state
from tests.userclasses import BIASLESS, FAITHFUL, NANOCHAT, NANOGPT_ERF, STYLES, Case, amplify_mlp, module

TOL = dict(rtol=1e-5, atol=1e-5)


def tokens(config, T=16, B=2, seed=0):
    return torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def hand_loaded(case: Case, ckpt, **build):
    """The class built at the checkpoint's shape with every parameter NaN, then hand-loaded: a parameter the loader
    missed would poison the logits."""
    _, config, canonical = load_state(ckpt)
    model = case.build(config, **build).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(math.nan)
    case.hand_load(model, canonical)
    return model, config


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    model = GPT.from_pretrained(tiny_ckpt)
    return lambda idx: model(idx)[0]


@pytest.mark.parametrize("case", FAITHFUL, ids=lambda c: c.id)
def test_faithful_class_hand_loaded_gives_gpt2_logits(case, tiny_ckpt, reference):
    model, config = hand_loaded(case, tiny_ckpt)
    idx = tokens(config)
    with torch.no_grad():
        got, want = case.logits(model, idx), reference(idx)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("case", [Case("syds"), Case("nanogpt", {"gelu": "tanh"}), Case("conv1d_style")],
                         ids=lambda c: c.id)
def test_shorter_class_holds_the_first_positions(case, tiny_ckpt, reference):
    """A class with a 32-position table, filled with GPT-2's first 32 positions, is GPT-2 on sequences that fit."""
    model, config = hand_loaded(case, tiny_ckpt, block_size=32)
    idx = tokens(config, T=32)
    with torch.no_grad():
        torch.testing.assert_close(case.logits(model, idx), reference(idx), **TOL)


def test_nanogpt_erf_gelu_is_its_only_difference(tiny_ckpt, tmp_path):
    # With every tensor in place, nanoGPT's default class is exactly GPT-2 with an erf GELU...
    model, config = hand_loaded(NANOGPT_ERF, tiny_ckpt)
    erf = GPT(dataclasses.replace(config, activation="gelu")).eval()
    erf.load_state_dict(GPT.from_pretrained(tiny_ckpt).state_dict())
    idx = tokens(config)
    with torch.no_grad():
        torch.testing.assert_close(NANOGPT_ERF.logits(model, idx), erf(idx)[0], **TOL)
    # ...and once GELU's inputs are as large as a trained model's, that difference shows beyond 1e-5.
    loud = amplify_mlp(tiny_ckpt, tmp_path / "loud")
    model, _ = hand_loaded(NANOGPT_ERF, loud)
    with torch.no_grad():
        gap = (NANOGPT_ERF.logits(model, idx) - GPT.from_pretrained(loud)(idx)[0]).abs().max().item()
    assert 1e-5 < gap < 1e-2


@pytest.mark.parametrize("case", BIASLESS, ids=lambda c: c.id)
def test_biasless_class_is_gpt2_without_the_biases_it_lacks(case, tiny_ckpt, reference):
    model, config = hand_loaded(case, tiny_ckpt)
    stripped = GPT.from_pretrained(tiny_ckpt)
    with torch.no_grad():
        for i in range(config.n_layer):
            for name in case.lacks:
                stripped.get_parameter(f"blocks.{i}.{name}").zero_()
    idx = tokens(config)
    with torch.no_grad():
        got = case.logits(model, idx)
        torch.testing.assert_close(got, stripped(idx)[0], **TOL)
        assert (got - reference(idx)).abs().max().item() > 1e-3  # the dropped biases matter


def test_nanochat_is_not_gpt2_shaped():
    model = module("nanochat").build()
    names = dict(model.named_parameters())
    V, C, L = 65536, 32, 2
    assert model.transformer.wte.weight.shape == (V, C)
    assert not any(n.endswith("bias") for n in names)
    assert not any(p.dim() == 2 and p.shape[0] == 64 for p in names.values())  # no position table
    # embedding + untied head + per block q, k, v, proj (C x C) and the MLP (2 x 4C x C); norms hold nothing
    assert sum(p.numel() for p in names.values()) == 2 * V * C + L * (4 * C * C + 8 * C * C)
    out = NANOCHAT.logits(model, torch.randint(0, V, (1, 8)))
    assert out.shape == (1, 8, V) and torch.isfinite(out).all()


@pytest.mark.parametrize("style", STYLES)
def test_every_class_builds_on_the_meta_device(style, tiny_ckpt):
    _, config, _ = load_state(tiny_ckpt)
    build = module(style).build
    with torch.device("meta"):
        model = build() if style == "nanochat" else build(config.vocab_size, config.n_positions, config.n_layer,
                                                          config.n_head, config.n_embd)
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.heavy  # a second size of a check the default run makes on the tiny model
@pytest.mark.fullsize
def test_syds_hand_loaded_at_124m_shape(gpt2_ckpt):
    case = Case("syds")
    model, config = hand_loaded(case, gpt2_ckpt)
    assert config.n_embd == 768 and config.n_layer == 12
    idx = tokens(config, T=8, B=1)
    with torch.no_grad():
        torch.testing.assert_close(case.logits(model, idx), GPT.from_pretrained(gpt2_ckpt)(idx)[0], **TOL)
