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


def test_ours_recompute_every_block_and_the_gradients_are_the_plain_ones(tiny_ckpt):
    """Ours' backward keeps one tensor per block (recompute.py) so `verify --grads` fits small machines; the
    gradients are those of the plain backward, bit for bit."""
    from gpt2port.training import recompute
    from gpt2port.verification.grads import _ours

    seen = []

    def load():
        seen.append(GPT.from_pretrained(tiny_ckpt))
        return seen[-1]

    _, loss, grads = _ours(load, ids_of())
    assert recompute.recomputed(seen[0]) == list(range(len(seen[0].blocks)))
    plain = GPT.from_pretrained(tiny_ckpt).float().eval()
    ids = ids_of()
    _, want = plain(ids[:, :-1], targets=ids[:, 1:])
    want.backward()
    assert loss == float(want.detach())
    for name, p in plain.named_parameters():
        assert torch.equal(grads[name], p.grad), name


def test_the_float64_references_gradients_are_transformers(tiny_ckpt, make_hf_repo):
    """Without transformers (hf=False) the reference is the float64 GPT-2's own, differentiated a block at a time:
    the same loss and gradients as transformers', within fp32's reach of ours."""
    ours = lambda: GPT.from_pretrained(tiny_ckpt)  # noqa: E731
    f64 = gradient_parity(ours, make_hf_repo("hub"), ids_of(), hf=False)
    hf = gradient_parity(ours, make_hf_repo("hub"), ids_of())
    assert f64["reference"] == "float64" and hf["reference"] == "transformers" and "loss_hf" not in f64
    assert f64["max_rel"] <= TOLERANCE and f64["loss_rel"] < 1e-6, f64
    assert abs(f64["loss_ref"] - hf["loss_hf"]) < 1e-6 * abs(hf["loss_hf"]) and hf["loss_ref"] == hf["loss_hf"]


@pytest.mark.parametrize("no_hf, name", [(True, "gradients vs the float64 reference"),
                                         (False, "gradients vs transformers (fp32)")])
def test_verify_grads_in_the_report(tiny_ckpt, no_hf, name):
    r = run_cli("verify", tiny_ckpt, "--grads", "--tokens", "16", *(["--no-hf"] if no_hf else []), "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    check = next(c for c in report["checks"] if c["name"].startswith("gradients"))
    assert check["name"] == name  # "vs transformers" only where transformers ran
    assert check["passed"] and report["metrics"]["grads"]["max_rel"] <= TOLERANCE


def test_verify_no_hf_grads_imports_no_transformers(tiny_ckpt):
    from tests.test_package import in_fresh_python

    r = in_fresh_python(
        "import sys\n"
        "from gpt2port.cli import main\n"
        "try:\n"
        f"    main.main(args=['verify', {str(tiny_ckpt)!r}, '--no-hf', '--grads', '--tokens', '16'], "
        "prog_name='gpt2port')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n")
    assert "PASS" in r.stdout and "gradients vs the float64 reference" in r.stdout and "transformers (fp32)" not in \
        r.stdout


def test_a_wrong_backward_is_caught_though_the_logits_agree(tiny_ckpt, make_hf_repo):
    """The MLP's activation applied to a detached input: every logit as GPT-2's, the fc layers' gradients zero."""
    model = GPT.from_pretrained(tiny_ckpt)
    for b in model.blocks:
        b.mlp.act = lambda x: F.gelu(x.detach(), approximate="tanh") + (x - x.detach()) * 0
    report = gpt2port.verify_model(model, make_hf_repo("hub"), tokens=16, hf=False, grads=True)
    failed = [c.name for c in report.checks if not c.passed]
    assert failed == ["gradients vs the float64 reference"], report.to_text()
    g = report.metrics["grads"]
    assert g["max_rel"] > 0.5 and g["worst"].startswith("blocks."), g  # the MLP and all it feeds back into
    assert model.blocks[0].mlp.fc.weight.grad is None  # the caller's model is left as it was
