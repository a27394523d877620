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
from tests.userclasses import BIASLESS, FAITHFUL, Case, module
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
    assert p["passed"] and p["tokens"] == config.n_positions == 64 and p["lengths"] == (64, 43)
    assert 0 <= p["rel"] <= 1e-5
    assert re.search(r"proof: logits equal GPT-2's to \S+ relative on 2 sequences of 64 and 43 tokens, batched and "
                     r"apart", str(report)), str(report)
    idx = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert rel(model(idx), GPT.from_pretrained(ckpt)(idx)[0]) <= 1e-5


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


# --- verify knows the history ----------------------------------------------------------------------------------

def verify_quick(model, reference):
    from gpt2port import verify_model

    return verify_model(model, reference, tokens=16, hf=False)


def test_verify_says_dropped_biases_are_their_cost_not_a_bug(narrow):
    hf, ckpt, config = narrow
    model = seedstyle(config, act="tanh", bias=False)
    load_into(model, ckpt, drop_biases=True)
    report = verify_quick(model, hf)
    first = report.localization["first_divergence"]
    assert not report.passed
    assert "the biases were dropped at load (drop_biases=True): this difference is their measured cost, not a bug" \
        in first, first
    assert "no known mistake" not in first
    assert report.localization["diagnosis"]["history"] and report.localization["diagnosis"]["rel_with"] <= 1e-5


def test_verify_runs_a_class_with_cropped_positions_within_its_context(narrow):
    hf, ckpt, config = narrow
    model = seedstyle_class.build(config.vocab_size, 32, config.n_layer, config.n_head, config.n_embd, act="tanh")
    load_into(model, ckpt, crop_positions=True)
    report = verify_quick(model, hf)
    assert report.passed, report.to_text()
    assert any("cropped at load to its first 32 of 64 rows" in n for n in report.notes), report.notes


def test_verify_names_the_erf_gelu_noted_at_load(narrow):
    hf, ckpt, config = narrow
    model = seedstyle(config)
    load_into(model, ckpt)
    report = verify_quick(model, hf)
    d = report.localization["diagnosis"]
    assert not report.passed and d["history"], report.localization
    assert "exact (erf) GELU, noted at load" in report.localization["first_divergence"]


def test_a_gpt2port_checkpoint_is_a_reference(narrow):
    _, ckpt, config = narrow
    model = seedstyle(config, act="tanh")
    load_into(model, ckpt)
    report = verify_quick(model, ckpt)
    assert report.passed, report.to_text()
    assert report.reference["path"] == str(ckpt)


def test_a_finetuned_checkpoint_failing_against_its_source_says_it_was_finetuned(narrow, tmp_path):
    from gpt2port.verification import run_verify
    from gpt2port.checkpoint import save_state

    hf, ckpt, config = narrow
    _, _, tensors = load_state(ckpt)
    state = {k: v.clone() for k, v in tensors.items()}
    state["blocks.0.mlp.fc.weight"] += 0.01 * torch.randn(state["blocks.0.mlp.fc.weight"].shape,
                                                          generator=torch.Generator().manual_seed(0))
    tuned = save_state(state, config, tmp_path / "tuned", origin=ckpt, kind="fine-tuned GPT",
                       record={"finetune": {"settings": {"steps": 20}}})
    report = run_verify(tuned, reference=hf, tokens=16, hf=False)
    first = report.localization["first_divergence"]
    assert not report.passed
    assert f"fine-tuned (20 steps) from {ckpt.resolve()}" in first, first
    assert "no known mistake" not in first
    # verify_model on the model loaded from it knows the same
    again = verify_quick(GPT.from_pretrained(tuned), hf)
    assert "fine-tuned" in again.localization["first_divergence"]


# --- smaller findings -------------------------------------------------------------------------------------------

def test_a_position_table_too_short_is_named_as_the_position_table(narrow):
    """A character-level class has more positions than tokens: its position table is not its token embedding."""
    _, ckpt, config = narrow
    model = seedstyle_class.build(16, 32, config.n_layer, config.n_head, config.n_embd, act="tanh")
    with pytest.raises(GPT2PortError) as err:
        load_into(model, ckpt)
    message = str(err.value)
    assert "tok_emb.weight: token embedding is (16, 64)" in message, message
    assert "pos_emb.weight: position table is (32, 64), GPT-2 needs (64, 64)" in message, message
    assert "pos_emb.weight: token embedding" not in message


class _PositionIds(seedstyle_class.GPT):
    """Registers its position ids on its parameters' device, as some tutorials do."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("pos_ids", torch.arange(self.pos_emb.weight.shape[0], device=self.pos_emb.weight.device))


def test_a_class_built_under_init_empty_is_not_told_to_build_under_init_empty(narrow):
    import gpt2port

    _, ckpt, config = narrow
    with gpt2port.init_empty():
        model = _PositionIds(config.vocab_size, config.n_positions, config.n_layer, config.n_head, config.n_embd,
                             act="tanh")
    with pytest.raises(GPT2PortError) as err:
        load_into(model, ckpt)
    message = str(err.value)
    assert "pos_ids" in message and "was built under gpt2port.init_empty()" in message, message
    assert "build the class under gpt2port.init_empty()" not in message


# --- every tutorial-style class, at realistic scales ----------------------------------------------------------------

@pytest.mark.parametrize("case", FAITHFUL + BIASLESS, ids=lambda c: c.id)
def test_each_class_loads_with_proof_at_realistic_scales(case, narrow):
    """At weights that tell activations, norms and attention apart, each class's load proves it computes GPT-2
    (GPT-2 without the biases it lacks, for the biasless ones), and its logits equal the hand-written loader's."""
    _, ckpt, config = narrow
    model = case.build(config)
    report = load_into(model, ckpt, drop_biases=bool(case.lacks))
    assert report.proof["passed"] and report.proof["rel"] <= 1e-5, report.proven
    twin = case.build(config)
    case.hand_load(twin, load_state(ckpt)[2])
    idx = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel(case.logits(model.eval(), idx), case.logits(twin.eval(), idx)) <= 1e-6
