"""The fast layers' oneDNN kernel against F.linear (gpt2port.fast.kernels), its switch, the activation table that config
validates against, that nothing a user calls moves the global random state, and that torch.export takes the forward
with its cache as tensors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import torch.nn as nn

from gpt2port import GPT, GPTConfig
from gpt2port.model import PastKV
from gpt2port.config import ACTIVATIONS
from gpt2port.errors import GPT2PortError
from gpt2port.fast import Settings, accelerate
from gpt2port.fast.kernels import onednn_works
from tests.support import ROOT


# Each snippet runs in a fresh process between two reads of the global RNG state. Fresh, because the oneDNN probe
# runs once per process, when generate first swaps the fast layers in: in a process where anything ran before, it has
# already run.
_RNG_CHILD = """
import sys
import torch
from gpt2port import GPT
ckpt = sys.argv[1]
{setup}
before = torch.get_rng_state()
{action}
print("unchanged" if torch.equal(torch.get_rng_state(), before) else "CHANGED")
"""
_LOAD = "model = GPT.from_pretrained(ckpt)"
_RNG_CASES = {
    "from_pretrained": ("", _LOAD),
    "forward": (_LOAD, "with torch.inference_mode():\n    model(torch.tensor([[464, 3290, 318]]))"),
    "generate": (_LOAD, "from gpt2port.generate import generate\n"
                        "generate(model, [[464, 3290]], 8, temperature=1.0, top_k=40, seed=3, stop_token=None)"),
    "verify": ("from gpt2port.verification import run_verify", "run_verify(ckpt, tokens=16, hf=False)"),
}


@pytest.mark.parametrize("case", sorted(_RNG_CASES))
def test_global_rng_state_is_untouched(tiny_ckpt, case):
    setup, action = _RNG_CASES[case]
    code = _RNG_CHILD.format(setup=setup, action=action)
    proc = subprocess.run([sys.executable, "-c", code, str(tiny_ckpt)], cwd=ROOT, env=dict(os.environ),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "unchanged", f"{case} moved torch's global RNG state"


@pytest.fixture
def pointwise_calls(monkeypatch):
    """The list that each call of oneDNN's linear kernel appends to (the op itself still runs)."""
    if not onednn_works():
        pytest.skip("this PyTorch build has no oneDNN linear kernel")
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0].shape) or real(*a))
    return calls


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (2, 7, 48)])
def test_onednn_linear_agrees_with_f_linear_and_switches_off(pointwise_calls, monkeypatch, bias, shape):
    g = torch.Generator().manual_seed(1)
    layer = accelerate(nn.Linear(48, 80, bias=bias), Settings(native=False))  # one row: not gpt2port's kernel
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(shape, generator=g)
    expected = F.linear(x, layer.weight, layer.bias).detach()
    with torch.inference_mode():
        fast = layer(x)
        assert len(pointwise_calls) == 1 and fast.shape == (*shape[:-1], 80)
        torch.testing.assert_close(fast, expected, rtol=1e-5, atol=1e-5)
        layer = accelerate(layer, Settings(native=False, onednn=False))
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
    assert len(pointwise_calls) == 1  # switched off: F.linear, not the kernel


def test_onednn_linear_is_for_fp32_inference_only(pointwise_calls):
    layer = accelerate(nn.Linear(16, 8), Settings())
    x = torch.ones(2, 16)
    layer(x).sum().backward()  # autograd on: F.linear, so gradients flow as nn.Linear's
    assert layer.weight.grad is not None
    with torch.inference_mode():
        layer.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert not pointwise_calls


# torch.compile's inductor imports PyTorch's own torch/utils/mkldnn.py, whose classes use torch.jit.script_method
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_torch_compile_for_inference():
    # Under torch.compile the fast layers leave the kernel choice to the compiler: oneDNN's op on a plain weight
    # cannot be traced.
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=48, vocab_size=203, n_positions=32)).eval()
    accelerate(model, Settings(native=False))
    compiled = torch.compile(model)
    with torch.no_grad():
        for idx in (torch.tensor([[7]]), torch.tensor([[3, 1, 4, 1, 5]])):
            torch.testing.assert_close(compiled(idx)[0], model(idx)[0], rtol=1e-5, atol=1e-5)


def test_config_accepts_exactly_the_activations_the_model_implements():
    for name, fn in ACTIVATIONS.items():
        assert GPTConfig(activation=name).activation == name and callable(fn)
    with pytest.raises(GPT2PortError, match="not supported"):
        GPTConfig(activation="mish")
    with pytest.raises(GPT2PortError, match="activation_function 'mish'"):
        GPTConfig.from_hf_config({"n_layer": 1, "n_head": 1, "n_embd": 4, "vocab_size": 8,
                                  "activation_function": "mish"})
    x = torch.linspace(-3, 3, 13)
    torch.testing.assert_close(ACTIVATIONS["gelu_new"](x), F.gelu(x, approximate="tanh"))


def test_logits_to_keep_computes_those_positions_logits():
    """The forward's logits_to_keep: the last k positions, or (B, K) positions per row; the same numbers as the
    full forward's at those positions (generation asks for the last one, evaluation for the positions it scores)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=16)).eval()
    idx = torch.randint(0, 97, (3, 11))
    with torch.no_grad():
        full = model(idx)[0]
        assert torch.equal(model(idx, logits_to_keep=0)[0], full)
        torch.testing.assert_close(model(idx, logits_to_keep=1)[0], full[:, -1:])
        torch.testing.assert_close(model(idx, logits_to_keep=4)[0], full[:, -4:])
        at = torch.tensor([[0, 5], [10, 10], [3, 2]])
        torch.testing.assert_close(model(idx, logits_to_keep=at)[0], full[torch.arange(3)[:, None], at])


def test_torch_export_takes_the_forward_with_the_cache_as_tensors():
    """torch.export captures GPT.forward with a PastKV, sequence and cache lengths dynamic; the one program then
    prefills from an empty cache and decodes token by token with the cache it returned, left padding included, and
    gives the logits of the plain forward over the whole sequence (realistic-scale weights, an odd shape)."""
    from gpt2port.targets.onnx import Step  # GPT.forward over a PastKV of flat tensors, returning the grown cache
    from tests.realistic import make_realistic_

    config = GPTConfig(n_layer=3, n_head=3, n_embd=24, vocab_size=67, n_positions=40)
    model = make_realistic_(GPT(config), seed=5).eval()
    batch, seq, past = (torch.export.Dim(n) for n in ("batch", "seq", "past"))
    dims = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: torch.export.Dim("total")},
            "position_ids": {0: batch, 1: seq}, "past": ({0: batch, 2: past},) * (2 * config.n_layer)}
    example = PastKV([torch.randn(2, 3, 4, 8) for _ in range(3)], [torch.randn(2, 3, 4, 8) for _ in range(3)])
    ids = torch.randint(0, 67, (2, 5))
    with torch.no_grad():
        program = torch.export.export(Step(model), (ids, torch.ones(2, 9, dtype=torch.long),
                                                     torch.arange(4, 9).expand(2, 5),
                                                     *[t for kv in zip(example.k, example.v) for t in kv]),
                                      dynamic_shapes=dims).module()
        tokens = torch.randint(0, 67, (2, 13))
        pad = torch.tensor([0, 3])  # row 1: 3 padding tokens, then the first 10 of row 0's
        tokens[1] = torch.cat((torch.zeros(3, dtype=torch.long), tokens[0, :10]))
        mask = (torch.arange(13) >= pad.view(-1, 1)).long()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = PastKV.empty(config, 2)
        past_tensors = [t for kv in zip(cache.k, cache.v) for t in kv]
        got = []
        for start, end in ((0, 6), *((i, i + 1) for i in range(6, 13))):  # a prompt of 6, then 7 single tokens
            logits, *past_tensors = program(tokens[:, start:end], mask[:, :end], positions[:, start:end],
                                            *past_tensors)
            got.append(logits)
        got = torch.cat(got, 1)
        assert past_tensors[0].shape == (2, 3, 13, 8)
        torch.testing.assert_close(got[0], model(tokens[:1])[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1, 3:], model(tokens[1:, 3:])[0][0], rtol=1e-5, atol=1e-5)
