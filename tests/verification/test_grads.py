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


class SavedFloat64:
    """The float64 bytes autograd holds for backward at once (saved_tensors_hooks: counted when a tensor is saved,
    released when the graph that saved it is freed), the peak per phase (the last progress message, numbers
    dropped): deterministic, unlike RSS, which also holds the allocator's freed memory."""

    class Held:
        def __init__(self, t):
            self.t = t

    def __init__(self):
        self.live, self.phase, self.peak = 0, "start", {}

    def say(self, message: str) -> None:
        self.phase = message
        self.said.append(message)

    def pack(self, t):
        if t.dtype != torch.float64:
            return t
        import weakref

        n = t.numel() * t.element_size()
        self.live += n
        self.peak[self.phase] = max(self.peak.get(self.phase, 0), self.live)
        held = self.Held(t)
        weakref.finalize(held, self._release, n)
        return held

    def _release(self, n: int) -> None:
        self.live -= n

    def unpack(self, held):
        return held.t if isinstance(held, self.Held) else held

    def run(self, fn, *args):
        self.said = []
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            return fn(*args)


def test_the_float64_references_gradients_are_taken_a_piece_at_a_time(tiny_ckpt, make_hf_repo, monkeypatch):
    """`verify --grads --no-hf` fits small machines because the float64 reference never holds the graph of more than
    one piece: one block's MLP half over ROWS positions or its attention half over one sequence, the head and loss
    over ROWS positions; each block is said as it is done. The gradients are those of the whole (transformers')."""
    from gpt2port.verification import grads64
    from gpt2port.verification.grads import _ours
    from gpt2port.verification.reference import Float64GPT2

    monkeypatch.setattr(grads64, "ROWS", 16)
    ids = ids_of(T=49)  # 2 x 48 positions: 6 slices of 16
    config, loss_ours, grads = _ours(lambda: GPT.from_pretrained(tiny_ckpt), ids)
    saved = SavedFloat64()
    with Float64GPT2(make_hf_repo("hub")) as ref:
        loss, max_rel, worst = saved.run(grads64.reference_gradients, ref, ids, config, dict(grads), saved.say)
        n, vocab, x = config.n_layer, config.vocab_size, ids[:, :-1]
        # what one whole block saves over one sequence, and the head and loss over all positions, at once
        h = ref.files.get64("wte.weight")[x[:1]].requires_grad_()
        w = {k: t.requires_grad_() for k, t in grads64._weights(ref, 0).items()}
        whole_block = SavedFloat64()
        whole_block.run(grads64._block, ref, h, w, 0)
        one_sequence = whole_block.peak["start"]
    whole_head = 2 * x.numel() * vocab * 8  # every position's log-softmax, saved by it and by the loss after it
    assert f"gradients: float64 reference forward, block {n}/{n}" in saved.said
    backward = [m for m in saved.said if "backward" in m]
    assert backward == [f"gradients: float64 reference backward, block {i}/{n}" for i in range(n, 0, -1)]
    for m in backward:
        assert saved.peak[m] <= one_sequence, (m, saved.peak[m], one_sequence)  # a whole batch: twice as much
    head = [m for m in saved.said if "head and loss" in m]
    assert len(head) == x.numel() // 16
    assert max(saved.peak[m] for m in head) <= 3 * 16 * vocab * 8 < whole_head / 2
    assert saved.live == 0  # every graph freed
    assert max_rel <= TOLERANCE and abs(loss - loss_ours) < 1e-6 * loss, (max_rel, worst, loss, loss_ours)
    full = gradient_parity(lambda: GPT.from_pretrained(tiny_ckpt), make_hf_repo("hub"), ids)  # transformers
    assert abs(loss - full["loss_hf"]) < 1e-6 * loss
