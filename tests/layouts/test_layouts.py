"""The layout tables and their transforms, checked on meta tensors at all four real GPT-2 shapes (nothing is
allocated), plus each transform's inverse and config inference from shapes."""

from __future__ import annotations

import pytest
import torch

from gpt2port.config import PRESETS, GPTConfig, canonical_name
from gpt2port.errors import GPT2PortError
from gpt2port.info import parameter_ledger
from gpt2port.layouts import GPT2PORT, HF, Layout, Row, canonical
from gpt2port.layouts.infer import check_config_matches_weights, infer_config
from gpt2port.layouts.transforms import IDENTITY, TRANSPOSE, AddDim, Chain, PadRows, Part, merge
from gpt2port.model import GPT

# Parameters of the four official sizes, tied head counted once, position embedding included.
OFFICIAL_PARAMS = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
                   "gpt2-xl": 1_557_611_200}
SMALL = GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=10, n_positions=4)


def _hf_meta_model(name):
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        return GPT2LMHeadModel(GPT2Config(**PRESETS[name]))


def _hf_keys(config):
    return [w.key.removeprefix(HF.write_prefix) for w in HF.plan_write(config)]


@pytest.mark.parametrize("name", list(PRESETS))
def test_hf_keys_map_onto_our_parameters_at_real_shapes(name):
    config = GPTConfig.preset(name)
    hf_sd = _hf_meta_model(name).state_dict()
    with torch.device("meta"):
        ours_sd = GPT(config).state_dict()

    reads, dropped, head = HF.plan_read(list(hf_sd), config, "meta")
    assert head == "lm_head.weight"  # HF's in-memory model names the (tied) head
    assert {r.target for r in reads} == set(ours_sd) - {"lm_head.weight"}
    for r in reads:
        assert r.transform.from_layout(hf_sd[r.key], ours_sd[r.target].shape).shape == ours_sd[r.target].shape, r
        assert r.transform.layout_shape(tuple(ours_sd[r.target].shape)) == tuple(hf_sd[r.key].shape)
    # Exactly the four Conv1D weights are transposed, in every layer.
    transposed = sorted({HF.strip(r.key).split(".", 2)[-1] for r in reads if r.transform is TRANSPOSE})
    assert transposed == ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"]


@pytest.mark.parametrize("name", list(PRESETS))
def test_parameter_totals_match_the_official_counts(name):
    config = GPTConfig.preset(name)
    with torch.device("meta"):
        model = GPT(config)
    assert model.num_params() == OFFICIAL_PARAMS[name]
    assert model.lm_head.weight is model.tok_emb.weight
    shapes = canonical.shapes(config)
    assert list(shapes) == [k for k in model.state_dict() if k != "lm_head.weight"]
    ledger = parameter_ledger(shapes, config.n_layer)
    assert sum(row["params"] for row in ledger) == OFFICIAL_PARAMS[name]
    assert ledger[-1] == {"part": "lm_head (tied to wte)", "params": 0}


@pytest.mark.parametrize("name", list(PRESETS))
def test_table_inverts_to_todays_hf_names(name):
    config = GPTConfig.preset(name)
    hf_keys = set(_hf_meta_model(name).state_dict()) - {"lm_head.weight"}
    back = HF.plan_write(config)
    assert {w.key for w in back} == hf_keys
    # Reading what was written gives back every canonical tensor through the inverse transform.
    reads, _, _ = HF.plan_read([w.key for w in back], config, "f")
    assert sorted((r.key, r.target) for r in reads) == sorted((w.key, w.source) for w in back)


def test_gpt2port_layout_is_the_identity():
    config = GPTConfig.preset("gpt2")
    writes = GPT2PORT.plan_write(config)
    assert [(w.key, w.source) for w in writes] == [(k, k) for k in canonical.shapes(config)]
    assert all(w.transform is IDENTITY for w in writes)


def test_hub_layout_buffers_are_dropped_by_name():
    keys = _hf_keys(SMALL) + ["h.0.attn.bias", "h.1.attn.bias", "h.0.attn.masked_bias", "h.1.attn.masked_bias"]
    reads, dropped, head = HF.plan_read(keys, SMALL, "f")
    assert sorted(dropped) == ["h.0.attn.bias", "h.0.attn.masked_bias", "h.1.attn.bias", "h.1.attn.masked_bias"]
    assert head is None and len(reads) == len(canonical.shapes(SMALL))
    assert HF.dropped == {"h.{}.attn.bias", "h.{}.attn.masked_bias"}
    assert len({row.key for row in HF.rows}) == len(HF.rows)


def test_unknown_missing_and_duplicate_keys_are_named():
    keys = _hf_keys(SMALL)
    with pytest.raises(GPT2PortError, match=r"weights.bin: unexpected keys: score.weight"):
        HF.plan_read(keys + ["score.weight"], SMALL, "weights.bin")
    with pytest.raises(GPT2PortError, match=r"missing keys: h.1.mlp.c_fc.bias"):
        HF.plan_read([k for k in keys if k != "h.1.mlp.c_fc.bias"], SMALL, "f")
    with pytest.raises(GPT2PortError, match=r"unexpected keys: h.2.ln_1.weight"):
        HF.plan_read(keys + ["h.2.ln_1.weight"], SMALL, "f")
    with pytest.raises(GPT2PortError, match=r"both hold 'wte.weight'"):
        HF.plan_read(keys + ["transformer.wte.weight"], SMALL, "f")


# --- transforms: each undoes itself ------------------------------------------------------------------------------

@pytest.mark.parametrize("transform", [IDENTITY, TRANSPOSE, AddDim(), PadRows(8), Chain(TRANSPOSE, AddDim()),
                                       Chain(PadRows(4), TRANSPOSE)], ids=repr)
def test_every_transform_undoes_itself(transform):
    t = torch.randn(6, 3)
    stored = transform.to_layout(t)
    assert tuple(stored.shape) == transform.layout_shape((6, 3))
    assert transform.canonical_shape(tuple(stored.shape))[1:] == (3,) or transform.canonical_shape(
        tuple(stored.shape)) == (6, 3)
    assert torch.equal(transform.from_layout(stored, (6, 3)), t)


def test_pad_rows_pads_with_zeros_up_to_the_multiple():
    stored = PadRows(128).to_layout(torch.ones(50257, 2))
    assert stored.shape == (50304, 2) and stored[50257:].abs().sum() == 0


@pytest.mark.parametrize("rest", [IDENTITY, TRANSPOSE], ids=repr)
def test_parts_merge_back_into_the_whole(rest):
    """q, k, v as three tensors, or one per head (3 x H parts), stored Linear- or Conv1D-style."""
    qkv = torch.randn(12, 4)
    for count in (3, 6):
        parts = [Chain(Part(i, count), rest) if rest is not IDENTITY else Part(i, count) for i in range(count)]
        stored = [(p, p.to_layout(qkv)) for p in parts]
        assert all(t.shape == p.layout_shape((12, 4)) for p, t in stored)
        assert torch.equal(merge(list(reversed(stored)), (12, 4)), qkv)
    with pytest.raises(GPT2PortError, match="cannot make a whole"):
        merge(stored[:2], (12, 4))


def test_a_layout_of_separate_qkv_reads_and_writes():
    """A table whose q, k and v are separate Linears: written apart, read back fused, bit-exact."""
    rows = tuple(Row(t, t) for t in canonical.TEMPLATES if "attn.qkv.weight" not in t) + tuple(
        Row("blocks.{}.attn.qkv.weight", f"blocks.{{}}.attn.{n}.weight", Part(i, 3)) for i, n in enumerate("qkv"))
    split = Layout("split-qkv", rows)
    writes = split.plan_write(SMALL)
    assert {w.key for w in writes} >= {"blocks.1.attn.q.weight", "blocks.1.attn.v.weight"}
    shapes = canonical.shapes(SMALL)
    whole = {name: torch.randn(shape) for name, shape in shapes.items()}
    stored = {w.key: w.transform.to_layout(whole[w.source]) for w in writes}
    reads, _, _ = split.plan_read(list(stored), SMALL, "f")
    by_target = {}
    for r in reads:
        by_target.setdefault(r.target, []).append((r.transform, stored[r.key]))
    assert all(torch.equal(merge(parts, shapes[n]), whole[n]) for n, parts in by_target.items())


# --- config from shapes ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(PRESETS))
def test_config_is_inferred_from_hf_shapes_at_official_sizes(name):
    config = GPTConfig.preset(name)
    shapes = HF.canonical_shapes({w.key: w.shape for w in HF.plan_write(config)})
    assert infer_config(shapes, "f") == config


def test_config_disagreeing_with_weights_is_named():
    shapes = canonical.shapes(GPTConfig.preset("gpt2"))
    with pytest.raises(GPT2PortError, match=r"config.json says 24 layers, width 1024, MLP width 4096 "
                                            r"\(gpt2-medium\); the weights hold 12 layers, width 768, MLP width "
                                            r"3072 \(gpt2\)"):
        check_config_matches_weights(GPTConfig.preset("gpt2-medium"), shapes, "repo/config.json")
    with pytest.raises(GPT2PortError, match="not an official GPT-2 size"):
        infer_config(canonical.shapes(SMALL), "f")


@pytest.mark.parametrize("alias,name", [("124M", "gpt2"), ("117M", "gpt2"), ("345M", "gpt2-medium"),
                                        ("355M", "gpt2-medium"), ("762M", "gpt2-large"), ("774M", "gpt2-large"),
                                        ("1.5B", "gpt2-xl"), ("1558M", "gpt2-xl"), ("1542M", "gpt2-xl"),
                                        ("openai-community/gpt2-large", "gpt2-large"), ("GPT2-XL", "gpt2-xl")])
def test_aliases(alias, name):
    assert canonical_name(alias) == name


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(GPT2PortError, match="unknown model name 'gpt3'.*gpt2, gpt2-medium, gpt2-large, gpt2-xl"):
        canonical_name("gpt3")
