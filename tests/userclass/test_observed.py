"""Issue 48: a block is whatever the class calls it, a proof never needs a guess.

Classes written fresh (tests/userclass/observed.py) in the shapes the fourth round found unproven: torch's
nn.TransformerEncoderLayer given the causal mask by the model, einops blocks as nn.ModuleList([attn, ff]) pairs, a
torch.compile'd model. Each is loaded, verified stage by stage, saved and checked, with the verdicts agreeing, on
a width-64 GPT-2 at a trained model's scales (tests/realistic.py)."""

from __future__ import annotations

import textwrap

import pytest
import torch

import gpt2port
from gpt2port import load_into, verify_model
from gpt2port.checkpoint import load_state
from scripts.hf_fixtures import TINY
from tests.realistic import realistic_checkpoint
from tests.support import run_cli
from tests.userclass import observed

NARROW = dict(TINY, n_embd=64)
PROOF = "2 sequences of 64 and 43 tokens, batched and apart"


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """(HF repo, gpt2port checkpoint, config) of a width-64 GPT-2 at realistic scales."""
    hf, ckpt = realistic_checkpoint(tmp_path_factory.mktemp("observed"), NARROW, seed=3)
    return hf, ckpt, load_state(ckpt)[1]


def build(config, kind, **options):
    model = observed.build(config, "module" if kind == "compiled" else kind, **options).eval()
    return torch.compile(model, backend="eager") if kind == "compiled" else model  # eager: no C++ compile


def proven_everywhere(narrow, model, tmp_path):
    """Load, verify (every block's attention and MLP judged), save (never loaded: read afresh) all agree."""
    hf, ckpt, config = narrow
    report = load_into(model, ckpt)
    assert PROOF in report.proven and report.proof["rel"] <= 1e-5, report.proven
    verdict = verify_model(model, hf, tokens=16, hf=False)
    assert verdict.passed, verdict.to_text()
    judged = {s["stage"] for s in verdict.localization["stages"]}
    assert {"block 0 attention", "block 1 attention", "block 1 MLP", "final norm"} <= judged, judged
    assert not verdict.localization.get("unobserved"), verdict.localization["unobserved"]
    object.__delattr__(model, "gpt2port_load")  # save_from reads the class afresh: n_head given, activation measured
    out = gpt2port.save_from(model, tmp_path / "saved", config={"n_head": config.n_head})
    assert out.report.max_rel <= 1e-5 and PROOF in out.report.proven


@pytest.mark.parametrize("kind", ["encoder", "einops", "compiled"])
def test_blocks_as_the_class_calls_them_are_proven(narrow, kind, tmp_path):
    proven_everywhere(narrow, build(narrow[2], kind), tmp_path)


def test_the_encoder_layer_is_re_run_with_the_mask_the_model_passes(narrow):
    """The stage run re-called block 0 without the mask: verify said "attention differs, rel 0.99"."""
    hf, ckpt, config = narrow
    model = build(config, "encoder")
    load_into(model, ckpt)
    stages = {s["stage"]: s for s in verify_model(model, hf, tokens=16, hf=False).localization["stages"]}
    assert stages["block 0 attention"]["rel"] <= 1e-5, stages["block 0 attention"]


USER_FILE = textwrap.dedent('''
    import torch
    from tests.userclass.observed import build

    def encoder(cfg):
        return build(cfg, "encoder")

    def einops(cfg):
        return build(cfg, "einops")

    def compiled(cfg):
        return torch.compile(build(cfg), backend="eager")
''')


@pytest.mark.parametrize("factory", ["encoder", "einops", "compiled"])
def test_check_passes_them(narrow, tmp_path, factory):
    _, ckpt, _ = narrow
    path = tmp_path / "observed_user.py"
    path.write_text(USER_FILE)
    r = run_cli("check", f"{path}:{factory}", ckpt, "--tokens", "16", "--no-hf")
    assert r.exit_code == 0, r.output
    assert "PASS" in r.output and "Traceback" not in r.output and "internal error" not in r.output, r.output


# --- names by role, the forward's signature --------------------------------------------------------------------------

def test_the_books_einsum_attention_pairs_bias_q_with_w_query(narrow, tmp_path):
    """Raw (d_in, d_out) W_query/W_key/W_value with bias_q/bias_k/bias_v: refused, "bias_q belongs to no weight",
    with advice to rebuild with bias=True, which the class already has."""
    proven_everywhere(narrow, build(narrow[2], "einsum"), tmp_path)


def test_bias_advice_is_given_only_where_the_class_has_no_vectors(narrow):
    """Vectors the forward adds where no pairing can see them: not "build with bias=True" (the class has them)."""
    _, ckpt, config = narrow
    with pytest.raises(gpt2port.GPT2PortError) as err:
        load_into(build(config, "einsum", unpaired=True), ckpt)
    message = str(err.value)
    assert "h.0.attn.c1: a vector of (64,) that belongs to no weight" in message, message
    assert "bias=True" not in message and "sit beside them" in message, message


def test_a_forward_that_requires_targets_is_called_with_the_next_tokens(narrow, tmp_path):
    """forward(idx, targets): a TypeError from the class, reported as an internal error."""
    proven_everywhere(narrow, build(narrow[2], "targets"), tmp_path)


def test_a_forward_argument_that_cannot_be_known_is_refused_in_one_line(narrow):
    class Tempered(observed.GPT):
        def forward(self, idx, temperature):
            return self.body(idx) / temperature

    _, ckpt, config = narrow
    model = Tempered(config.vocab_size, config.n_positions, config.n_layer, config.n_head, config.n_embd)
    with pytest.raises(gpt2port.GPT2PortError) as err:
        load_into(model, ckpt)
    assert "Tempered.forward requires `temperature`" in str(err.value), err.value
    assert len(str(err.value).splitlines()) <= 2, err.value


def test_an_interleaved_qkv_is_refused_not_crashed(narrow):
    """`(h three d)`: each head's q, k, v side by side in one projection; load_into ended in IndexError."""
    _, ckpt, config = narrow
    with pytest.raises(gpt2port.GPT2PortError, match="block 0: attention output differs"):
        load_into(build(config, "einops", qkv="interleaved"), ckpt)


# --- a diagnosis the class does not contradict ------------------------------------------------------------------------

@pytest.mark.parametrize("plant, stage, cause", [
    ("normed_residual", "block 0: MLP output differs", "the residual added from the normed input"),
    ("parallel", "block 0: block output differs", "attention and MLP in parallel"),
    ("dropout", "block 0: attention output differs", "the forward is not deterministic in eval mode: "
                                                     "two runs on one input differ"),
])
def test_a_misleading_diagnosis_is_replaced_by_the_cause(narrow, plant, stage, cause):
    """Blamed on "ReLU instead of GELU" or "LayerNorm eps 1e-08" (the class has the tanh GELU and eps 1e-5), on
    "logits differ", on "mask off by one"."""
    hf, ckpt, config = narrow
    model = build(config, "module", plant=plant)
    with pytest.raises(gpt2port.GPT2PortError) as err:
        load_into(model, ckpt)
    message = str(err.value)
    assert stage in message and cause in message, message
    for wrong in ("ReLU", "LayerNorm eps", "mask off by one", "logits differ"):
        assert wrong not in message, message
    verdict = verify_model(model, hf, tokens=16, hf=False)
    assert not verdict.passed and cause in verdict.localization["first_divergence"], verdict.to_text()


def test_an_erf_gelu_computed_by_a_function_gets_the_erf_note_on_every_path(narrow, tmp_path):
    """nn.TransformerEncoderLayer(activation='gelu'): refused with "no known mistake" instead of the erf note."""
    hf, ckpt, config = narrow
    model = build(config, "encoder", act="erf")
    report = load_into(model, ckpt)
    assert any("measures as the exact (erf) GELU" in n for n in report.notes), report.notes
    assert "with the exact (erf) GELU" in report.proven and "tanh GELU they differ by" in report.proven
    verdict = verify_model(model, hf, tokens=16, hf=False)
    assert "the exact (erf) GELU, noted at load" in verdict.localization["first_divergence"], verdict.to_text()
    object.__delattr__(model, "gpt2port_load")
    out = gpt2port.save_from(model, tmp_path / "erf", config={"n_head": config.n_head})
    assert any("the exact (erf) GELU" in n for n in out.report.notes), out.report.notes
