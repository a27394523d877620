"""load_into on users' own classes (tests/userclasses.py): logits equal gpt2port's GPT, parameters equal what a
hand-written loader puts there, refusals name the module and the reason, and the options do what they say."""

from __future__ import annotations

import pytest
import torch

import gpt2port
from gpt2port import GPT
from gpt2port.checkpoint import load_state
from tests import userclasses as U
from tests.conftest import TINY

V, P, L, H, C = TINY["vocab_size"], TINY["n_positions"], TINY["n_layer"], TINY["n_head"], TINY["n_embd"]

LOADS = {
    "syds": (U.syds, {}),
    "opaque": (U.opaque, {}),
    "llms qkv_bias": (U.llms, {"qkv_bias": True}),
    "llms fused": (U.llms, {"qkv_bias": True, "fused": True}),
    "mingpt": (U.mingpt, {}),
    "nanogpt tanh": (U.nanogpt, {"gelu": "tanh"}),
    "lecture gpt2-faithful": (U.lecture, {"bias": True, "act": "gelu_tanh"}),
    "kader with biases": (U.kader, {"bias": True, "gelu": "tanh"}),
}


def full_logits(model, ids):
    from gpt2port.userclass.observe import call_logits

    with torch.no_grad():
        return call_logits(model, ids)


def ids_of(T=24, seed=0):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def ours(tiny_ckpt):
    return GPT.from_pretrained(tiny_ckpt)


@pytest.mark.parametrize("style", list(LOADS))
def test_loads_and_computes_gpt2(style, tiny_ckpt, ours):
    build, kw = LOADS[style]
    model = build(V, P, L, H, C, **kw)
    report = gpt2port.load_into(model, tiny_ckpt)
    ids = ids_of()
    with torch.no_grad():
        torch.testing.assert_close(full_logits(model, ids), ours(ids), rtol=1e-5, atol=1e-5)
    twin = build(V, P, L, H, C, **kw)
    U.hand_load(twin, load_state(tiny_ckpt)[2])
    mine, theirs = model.state_dict(), twin.state_dict()
    assert mine.keys() == theirs.keys()
    for k in mine:
        assert torch.equal(mine[k], theirs[k]), k
    text = str(report)
    for name, _ in model.named_parameters():
        assert name.split(".")[0] in text


def test_an_hf_directory_is_a_source_too(make_hf_repo, ours):
    model = U.syds(V, P, L, H, C)
    gpt2port.load_into(model, make_hf_repo("hub"))
    ids = ids_of()
    with torch.no_grad():
        torch.testing.assert_close(full_logits(model, ids), ours(ids), rtol=1e-5, atol=1e-5)


def test_head_bias_is_zeroed_and_said(tiny_ckpt):
    model = U.opaque(V, P, L, H, C)
    report = gpt2port.load_into(model, tiny_ckpt)
    assert torch.count_nonzero(model.lm_head.bias) == 0
    assert any("lm_head.bias: set to zero" in n for n in report.notes + report.layout.notes)


def test_nanogpt_erf_gelu_loads_exactly_and_is_noted(tiny_ckpt):
    model = U.nanogpt(V, P, L, H, C)  # nn.GELU(): exact erf, not GPT-2's tanh approximation
    report = gpt2port.load_into(model, tiny_ckpt)
    twin = U.nanogpt(V, P, L, H, C)
    U.hand_load(twin, load_state(tiny_ckpt)[2])
    for (k, a), (_, b) in zip(model.state_dict().items(), twin.state_dict().items()):
        assert torch.equal(a, b), k
    assert any("exact (erf) GELU" in n for n in report.layout.notes)


@pytest.mark.parametrize("style,build,kw,where", [
    ("kader", U.kader, {}, "blocks.0.attn.qkv"),
    ("gpt_mini", U.gpt_mini, {}, "blocks.0.attn.qkv"),
    ("llms default", U.llms, {}, "trf_blocks.0.att.W_query"),
    ("lecture", U.lecture, {"act": "gelu_tanh"}, "blocks.0.sa.heads.0.key"),
])
def test_missing_biases_are_refused_then_measured_on_request(style, build, kw, where, tiny_ckpt):
    with pytest.raises(gpt2port.GPT2PortError, match=rf"{where}.*no bias, but GPT-2 has one.*drop_biases=True"):
        gpt2port.load_into(build(V, P, L, H, C, **kw), tiny_ckpt)
    report = gpt2port.load_into(build(V, P, L, H, C, **kw), tiny_ckpt, drop_biases=True)
    cost = report.cost
    assert 0 <= cost["greedy_agreement"] <= 1 and cost["kl_mean"] >= 0 and cost["max_rel"] > 0
    assert "cost of the dropped biases" in str(report)


def test_a_relu_mlp_is_not_gpt2(tiny_ckpt):
    with pytest.raises(gpt2port.GPT2PortError, match=r"blocks.0.ffwd: the activation .* measures as ReLU"):
        gpt2port.load_into(U.lecture(V, P, L, H, C, bias=True, act="relu"), tiny_ckpt)


def test_nanochat_is_refused_with_every_reason(tiny_ckpt):
    with pytest.raises(gpt2port.userclass.LoadRefused) as e:
        gpt2port.load_into(U.nanochat(V, P, L, H, C), tiny_ckpt)
    text = "\n".join(e.value.reasons)
    for said in ("65536", "no learned position table", "no final LayerNorm", "ReLU²", "no bias"):
        assert said in text, said
    assert len(e.value.reasons) >= 5


def test_shorter_context_is_refused_unless_cropped(tiny_ckpt, ours):
    with pytest.raises(gpt2port.GPT2PortError, match="32 positions, the checkpoint has 64.*crop_positions=True"):
        gpt2port.load_into(U.syds(V, 32, L, H, C), tiny_ckpt)
    model = U.syds(V, 32, L, H, C)
    report = gpt2port.load_into(model, tiny_ckpt, crop_positions=True)
    assert any("first 32 of the checkpoint's 64 positions" in n for n in report.notes)
    ids = ids_of(T=32)
    with torch.no_grad():
        torch.testing.assert_close(full_logits(model, ids), ours(ids), rtol=1e-5, atol=1e-5)


def test_other_width_is_refused_with_the_config_to_build(tiny_ckpt):
    with pytest.raises(gpt2port.GPT2PortError, match=r"build the class with vocab_size=50257, n_positions=64 .*"
                                                     r"n_embd=32, n_layer=2, n_head=4"):
        gpt2port.load_into(U.syds(V, P, L, H, 64), tiny_ckpt)


@pytest.mark.parametrize("style", ["syds", "opaque", "nanogpt tanh"])
def test_meta_built_classes_load(style, tiny_ckpt, ours):
    build, kw = LOADS[style]
    with gpt2port.init_empty():
        model = build(V, P, L, H, C, **kw)
    gpt2port.load_into(model, tiny_ckpt)
    assert not any(p.is_meta for p in model.parameters())
    ids = ids_of()
    with torch.no_grad():
        torch.testing.assert_close(full_logits(model, ids), ours(ids), rtol=1e-5, atol=1e-5)


def test_allocated_parameters_stay_the_same_objects_and_tie_on_request(tiny_ckpt):
    model = U.syds(V, P, L, H, C)
    before = {n: id(p) for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters())
    report = gpt2port.load_into(model, tiny_ckpt)
    assert {n: id(p) for n, p in model.named_parameters()} == before
    assert {id(p) for g in opt.param_groups for p in g["params"]} == set(before.values())
    assert any("untied; holds a copy of the token embedding" in n for n in report.notes)
    assert model.output_projection.weight is not model.token_embedding.weight
    model = U.syds(V, P, L, H, C)
    report = gpt2port.load_into(model, tiny_ckpt, tie=True)
    assert model.output_projection.weight is model.token_embedding.weight
    with pytest.raises(gpt2port.GPT2PortError, match="tie=False, but the class ties its head"):
        gpt2port.load_into(U.kader(V, P, L, H, C, bias=True), tiny_ckpt, tie=False)


def test_layout_of_is_a_table_a_person_reads():
    text = str(gpt2port.layout_of(U.llms(V, P, L, H, C, qkv_bias=True)))
    assert "trf_blocks.{i}.att.W_key.weight     blocks.{i}.attn.qkv.weight   part(1/3)" in text
    assert "out_head.weight" in text and "untied" in text
    for name in ("tok_emb.weight", "final_norm.scale", "trf_blocks.{i}.ff.layers.2.bias"):
        assert sum(line.startswith(name + " ") for line in text.splitlines()) == 1, name


def test_verify_model_judges_a_users_class(tiny_ckpt, make_hf_repo):
    model = U.syds(V, P, L, H, C)
    gpt2port.load_into(model, tiny_ckpt)
    report = gpt2port.verify_model(model, make_hf_repo("hub"), tokens=16, hf=False)
    assert report.passed, report.to_text()
    stages = {s["stage"] for s in report.localization["stages"]}
    assert {"embeddings", "block 1 attention", "block 1 MLP", "final norm", "head"} <= stages


def test_gpt2_size_into_a_meta_built_class(gpt2_ckpt):
    with gpt2port.init_empty():
        model = U.syds(50257, 1024, 12, 12, 768)
    gpt2port.load_into(model, gpt2_ckpt)
    ours = GPT.from_pretrained(gpt2_ckpt)
    ids = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(full_logits(model, ids), ours(ids), rtol=1e-5, atol=1e-5)
