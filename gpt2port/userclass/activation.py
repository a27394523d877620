"""The MLP's activation, measured: what the MLP's second layer receives, against each known activation of what its
first layer returned, on one short forward pass. GPT-2 uses the tanh approximation of GELU; a class with ReLU,
ReLU² or SiLU is a different architecture, and one with the exact (erf) GELU computes GPT-2 only approximately."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from gpt2port.userclass.layout import Modules
from gpt2port.userclass.observe import call_logits, evaluating, first_tensor

GPT2 = "tanh-approximated GELU"
ERF = "exact (erf) GELU"
ACTIVATIONS = {
    GPT2: lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3)))),
    ERF: lambda x: 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0))),
    "ReLU": F.relu,
    "ReLU²": lambda x: F.relu(x).square(),
    "SiLU": F.silu,
    "no activation": lambda x: x,
}


@torch.no_grad()
def measure(model: nn.Module, mods: Modules, ids: torch.Tensor) -> tuple[str, float] | None:
    """(the activation that explains block 0's MLP best, its relative error), or None where it cannot be measured
    (no separate MLP layers, or weights without values on the meta device)."""
    if not (mods.mlp_in and mods.mlp_out) or any(p.is_meta for p in model.parameters()):
        return None
    block = mods.block(0)
    first, second = (model.get_submodule(f"{block}.{n}") for n in (mods.mlp_in, mods.mlp_out))
    got: dict[str, torch.Tensor] = {}
    hooks = [first.register_forward_hook(lambda m, a, out: got.setdefault("pre", first_tensor(out))),
             second.register_forward_pre_hook(lambda m, a: got.setdefault("post", first_tensor(a)))]
    try:
        with torch.random.fork_rng(devices=[]), evaluating(model):
            call_logits(model, ids)
    except Exception:  # noqa: BLE001 - a class that cannot run here is judged on its shapes alone
        return None
    finally:
        for h in hooks:
            h.remove()
    pre, post = got.get("pre"), got.get("post")
    if pre is None or post is None or pre.shape != post.shape:
        return None
    pre, post = pre.double(), post.double()
    scale = float(post.abs().max()) or 1.0
    errors = {name: float((f(pre) - post).abs().max()) / scale for name, f in ACTIVATIONS.items()}
    best = min(errors, key=errors.get)
    return best, errors[best]
