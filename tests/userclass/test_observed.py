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
