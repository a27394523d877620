"""The small layers gpt2port.fast swaps in for a decode step (layers.c): LayerNorm and GPT-2's tanh GELU on one fp32
row, against PyTorch's at a trained model's scales, where the model uses them, and put back as they were."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2port import GPT, GPTConfig
from gpt2port.fast import Settings, accelerate, kernels, restore
from gpt2port.fast.kernels import GPT2_GELU, FastLayerNorm, accelerated, fast_gelu_tanh

pytestmark = pytest.mark.usefixtures("native_kernels")
CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=48, vocab_size=203, n_positions=32)


def realistic(*shape: int, seed: int = 0) -> torch.Tensor:
    """Activations as a trained model's: std ~2, a few outlier channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 2
    x[..., 3] = 60.0
    x[..., -1] = -25.0
    return x


@pytest.mark.parametrize("n", [5, 16, 37, 768, 1600])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_equals_pytorchs(n, affine):
    x = realistic(3, n)
    g = torch.Generator().manual_seed(1)
    w, b = (1 + 0.3 * torch.randn(n, generator=g), torch.randn(n, generator=g)) if affine else (None, None)
    got = torch.ops.gpt2port.layer_norm(x, w, b, 1e-5)
    torch.testing.assert_close(got, F.layer_norm(x, (n,), w, b, 1e-5), rtol=1e-5, atol=1e-5)
    # another eps is read, not assumed
    torch.testing.assert_close(torch.ops.gpt2port.layer_norm(x, w, b, 0.5), F.layer_norm(x, (n,), w, b, 0.5),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 15, 16, 3072, 6401])
def test_gelu_equals_pytorchs_tanh_gelu(n):
    x = realistic(n) if n > 3 else torch.tensor([0.7])
    got = torch.ops.gpt2port.gelu_tanh(x)
    torch.testing.assert_close(got, F.gelu(x, approximate="tanh"), rtol=1e-5, atol=1e-6)
    # far from 0 it is no longer close to erf's GELU: the tanh formula it must be, not another one
    mid = torch.linspace(-3, 3, 61)
    assert (torch.ops.gpt2port.gelu_tanh(mid) - F.gelu(mid)).abs().max() > 1e-4


def test_gelu_at_its_edges_is_pytorchs():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e20, -1e20, 0.0, -0.0, -9.0, -5.0, 4.0])
    torch.testing.assert_close(torch.ops.gpt2port.gelu_tanh(x), F.gelu(x, approximate="tanh"), rtol=1e-5, atol=1e-7,
                               equal_nan=True)


def test_the_operators_refuse_what_they_would_read_wrong():
    with pytest.raises(ValueError, match="gpt2port::layer_norm takes fp32 rows"):
        torch.ops.gpt2port.layer_norm(torch.zeros(2, 8, dtype=torch.bfloat16), None, None, 1e-5)
    with pytest.raises(ValueError, match="gpt2port::layer_norm takes fp32 rows"):
        torch.ops.gpt2port.layer_norm(torch.zeros(2, 8), torch.ones(7), None, 1e-5)
    with pytest.raises(ValueError, match="gpt2port::gelu_tanh takes fp32"):
        torch.ops.gpt2port.gelu_tanh(torch.zeros(4, dtype=torch.float16))


def logits_of_steps(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a prompt's last token, then of each later token fed one at a time (what a decode step runs)."""
    from gpt2port.model import KVCache

    cache = KVCache(model.config, 1, ids.size(1))
    out = [model(ids[:, :4], cache=cache, logits_to_keep=1)[0]]
    out += [model(ids[:, p : p + 1], cache=cache, pos=p)[0] for p in range(4, ids.size(1))]
    return torch.cat(out, dim=1)


def test_a_model_takes_them_for_one_row_and_gets_its_own_numbers(monkeypatch):
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    with torch.no_grad():  # trained-like scales: LayerNorm gains 1 +- 0.3, biases, wide pre-activations
        for name, p in model.named_parameters():
            norm_gain = ("ln" in name or "norm" in name) and name.endswith("weight")
            p.copy_(1 + 0.3 * torch.randn_like(p) if norm_gain else torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5))
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    with torch.inference_mode():
        want = logits_of_steps(model, ids)
    calls = []
    kernels._gelu_agrees()  # its probe, before the calls are counted
    monkeypatch.setattr("gpt2port.fast.kernels._entry", lambda name: counted(name, calls))
    accelerate(model, Settings())
    assert all(type(m) is FastLayerNorm for m in model.modules() if isinstance(m, nn.LayerNorm))
    assert all(b.mlp.act is fast_gelu_tanh for b in model.blocks)
    with torch.inference_mode():
        got = logits_of_steps(model, ids)
    # the prompt's 4 rows keep PyTorch's (but for the final norm of the one row whose logits are kept); each
    # one-token step takes layers.c's
    steps = ids.size(1) - 4
    assert calls.count("layer_norm") == (2 * CONFIG.n_layer + 1) * steps + 1
    assert calls.count("gelu_tanh") == CONFIG.n_layer * steps
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    restore(model)
    assert all(type(m) is nn.LayerNorm for m in model.modules() if isinstance(m, nn.LayerNorm))
    assert all(b.mlp.act is GPT2_GELU for b in model.blocks)


def counted(name: str, calls: list):
    op = getattr(torch.ops.gpt2port, name).default

    def call(*args):
        calls.append(name)
        return op(*args)
    return call


def test_autograd_and_other_activations_keep_pytorchs():
    torch.manual_seed(0)
    model = accelerate(GPT(CONFIG), Settings())
    x = torch.randn(1, 1, CONFIG.n_embd, requires_grad=True)
    ln = model.blocks[0].ln1
    # through nn.LayerNorm's forward: a gradient, where the operator has none
    (ln(x) * torch.arange(CONFIG.n_embd)).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    other = GPT(GPTConfig(**{**CONFIG.__dict__, "activation": "gelu"}))
    accelerate(other, Settings())
    assert all(b.mlp.act is F.gelu for b in other.blocks)  # the exact GELU is not GPT-2's: left as it is
    mine = GPT(CONFIG)
    mine.blocks[0].mlp.act = lambda t: F.gelu(t, approximate="tanh")  # a user's own function, even the same one
    accelerate(mine, Settings())
    assert mine.blocks[0].mlp.act is not fast_gelu_tanh and mine.blocks[1].mlp.act is fast_gelu_tanh


def test_accelerated_puts_back_the_very_same_layers():
    model = GPT(CONFIG).eval()
    lns = [m for m in model.modules() if type(m) is nn.LayerNorm]
    with accelerated(model, Settings()) as fast:
        assert all(type(m) is FastLayerNorm for m in fast.modules() if isinstance(m, nn.LayerNorm))
        assert fast.blocks[0].mlp.act is fast_gelu_tanh
    assert [m for m in model.modules() if isinstance(m, nn.LayerNorm)] == lns
    assert all(b.mlp.act is GPT2_GELU for b in model.blocks)
    # without native kernels nothing of layers.c is used
    accelerate(model, Settings(native=False))
    assert all(type(m) is nn.LayerNorm for m in model.modules() if isinstance(m, nn.LayerNorm))
    assert all(b.mlp.act is GPT2_GELU for b in model.blocks)


def test_an_edited_activation_is_left_to_run_as_it_is(monkeypatch):
    """The GELU is swapped only where layers.c computes what activations.py's function does now."""
    kernels._gelu_agrees.cache_clear()
    monkeypatch.setattr(kernels, "GPT2_GELU", lambda x: F.gelu(x))  # as if the formula were edited to erf's
    model = GPT(CONFIG)
    monkeypatch.setattr(model.blocks[0].mlp, "act", kernels.GPT2_GELU)
    try:
        accelerate(model, Settings())
        assert model.blocks[0].mlp.act is kernels.GPT2_GELU
    finally:
        kernels._gelu_agrees.cache_clear()
