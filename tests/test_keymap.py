"""The key map, checked on meta tensors at all four real GPT-2 shapes: no weight is ever allocated."""

from __future__ import annotations

import pytest
import torch

from gpt2port.config import PRESETS, GPTConfig, canonical_name
from gpt2port.errors import GPT2PortError
from gpt2port.info import parameter_ledger
from gpt2port.keymap import (DROPPED, KEYMAP, apply, expected_shapes, hf_key_for, plan_hf_to_ours, plan_ours_to_hf,
                             source_shape)
from gpt2port.model import GPT

# BRIEF §3: parameters, tied head counted once, position embedding included.
OFFICIAL_PARAMS = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
                   "gpt2-xl": 1_557_611_200}


def _hf_meta_model(name):
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        return GPT2LMHeadModel(GPT2Config(**PRESETS[name]))


@pytest.mark.parametrize("name", list(PRESETS))
def test_hf_keys_map_onto_our_parameters_at_real_shapes(name):
    config = GPTConfig.preset(name)
    hf = _hf_meta_model(name)
    hf_sd = hf.state_dict()
    with torch.device("meta"):
        ours = GPT(config)
    ours_sd = ours.state_dict()

    mappings, dropped, head = plan_hf_to_ours(list(hf_sd), config, "meta")
    assert head == "lm_head.weight"  # HF's in-memory model names the (tied) head
    assert {m.target for m in mappings} == set(ours_sd) - {"lm_head.weight"}
    for m in mappings:
        assert apply(m.transform, hf_sd[m.source]).shape == ours_sd[m.target].shape, m
        assert source_shape(m, tuple(ours_sd[m.target].shape)) == tuple(hf_sd[m.source].shape)
    # Exactly the four Conv1D weights are transposed, in every layer.
    transposed = sorted({m.source.split(".", 3)[-1] for m in mappings if m.transform})
    assert transposed == ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"]


@pytest.mark.parametrize("name", list(PRESETS))
def test_parameter_totals_match_the_official_counts(name):
    config = GPTConfig.preset(name)
    with torch.device("meta"):
        model = GPT(config)
    assert model.num_params() == OFFICIAL_PARAMS[name]
    assert model.lm_head.weight is model.tok_emb.weight
    shapes = expected_shapes(config)
    ledger = parameter_ledger(shapes, config.n_layer)
    assert sum(row["params"] for row in ledger) == OFFICIAL_PARAMS[name]
    assert ledger[-1] == {"part": "lm_head (tied to wte)", "params": 0}


@pytest.mark.parametrize("name", list(PRESETS))
def test_table_inverts_to_todays_hf_names(name):
    config = GPTConfig.preset(name)
    hf_keys = set(_hf_meta_model(name).state_dict()) - {"lm_head.weight"}
    back = plan_ours_to_hf(config)
    assert {m.target for m in back} == hf_keys
    assert all(hf_key_for(m.source) == m.target.removeprefix("transformer.") for m in back)


def test_hub_layout_buffers_are_dropped_by_name():
    config = GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=10, n_positions=4)
    keys = [hf_key_for(k) for k in expected_shapes(config)] + ["h.0.attn.bias", "h.1.attn.bias",
                                                              "h.0.attn.masked_bias", "h.1.attn.masked_bias"]
    mappings, dropped, head = plan_hf_to_ours(keys, config, "f")
    assert sorted(dropped) == ["h.0.attn.bias", "h.0.attn.masked_bias", "h.1.attn.bias", "h.1.attn.masked_bias"]
    assert head is None and len(mappings) == len(expected_shapes(config))
    assert DROPPED == {"h.{}.attn.bias", "h.{}.attn.masked_bias"}
    assert len({hf for hf, _, _ in KEYMAP}) == len(KEYMAP)


def test_unknown_missing_and_duplicate_keys_are_named():
    config = GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=10, n_positions=4)
    keys = [hf_key_for(k) for k in expected_shapes(config)]
    with pytest.raises(GPT2PortError, match=r"weights.bin: unexpected keys: score.weight"):
        plan_hf_to_ours(keys + ["score.weight"], config, "weights.bin")
    with pytest.raises(GPT2PortError, match=r"missing keys: h.1.mlp.c_fc.bias"):
        plan_hf_to_ours([k for k in keys if k != "h.1.mlp.c_fc.bias"], config, "f")
    with pytest.raises(GPT2PortError, match=r"unexpected keys: h.2.ln_1.weight"):
        plan_hf_to_ours(keys + ["h.2.ln_1.weight"], config, "f")
    with pytest.raises(GPT2PortError, match=r"both hold 'wte.weight'"):
        plan_hf_to_ours(keys + ["transformer.wte.weight"], config, "f")


@pytest.mark.parametrize("alias,name", [("124M", "gpt2"), ("117M", "gpt2"), ("345M", "gpt2-medium"),
                                        ("355M", "gpt2-medium"), ("762M", "gpt2-large"), ("774M", "gpt2-large"),
                                        ("1.5B", "gpt2-xl"), ("1558M", "gpt2-xl"), ("1542M", "gpt2-xl"),
                                        ("openai-community/gpt2-large", "gpt2-large"), ("GPT2-XL", "gpt2-xl")])
def test_aliases(alias, name):
    assert canonical_name(alias) == name


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(GPT2PortError, match="unknown model name 'gpt3'.*gpt2, gpt2-medium, gpt2-large, gpt2-xl"):
        canonical_name("gpt3")
