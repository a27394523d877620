"""The MLP's activation, measured: the MLP module's input and output on one short forward pass, its output
recomputed from its own weights with each known activation. GPT-2 uses the tanh approximation of GELU; a class with
ReLU, ReLU² or SiLU is a different architecture, and one with the exact (erf) GELU computes GPT-2 only
approximately."""

from __future__ import annotations

import torch
from torch import nn

from gpt2port.userclass.layout import UserLayout
from gpt2port.userclass.observe import call_logits, evaluating, first_tensor
from gpt2port.verification.reference import ACTIVATIONS as FORMULAS  # the float64 reference's own, by HF name

GPT2 = "tanh-approximated GELU"
ERF = "exact (erf) GELU"
ACTIVATIONS = {
    GPT2: FORMULAS["gelu_new"],
    ERF: FORMULAS["gelu"],
    "ReLU": FORMULAS["relu"],
    "ReLU²": lambda x: FORMULAS["relu"](x).square(),
    "SiLU": FORMULAS["silu"],
    "no activation": lambda x: x,
}


@torch.no_grad()
def measure(model: nn.Module, lay: UserLayout, ids: torch.Tensor) -> dict[str, float] | None:
    """How far each known activation is from explaining block 0's MLP (relative error), or None where it cannot
    be measured
    (the MLP is not a module of its own, or the weights have no values on the meta device).

    The MLP module's input and output are captured on one forward pass; its output is then recomputed from its
    own weights (as the layout reads them) with each candidate activation."""
    mods = lay.modules
    if not mods.mlp or any(p.is_meta for p in model.parameters()):
        return None
    weights = _mlp_weights(model, lay)
    if weights is None:
        return None
    module = model.get_submodule(f"{mods.block(0)}.{mods.mlp}")
    got: dict[str, torch.Tensor] = {}
    def keep(m, args, out):  # returns None: a forward hook that returns a value replaces the output
        got.setdefault("io", (first_tensor(args), first_tensor(out)))

    hook = module.register_forward_hook(keep)
    try:
        with torch.random.fork_rng(devices=[]), evaluating(model):
            call_logits(model, ids)
    except Exception:  # noqa: BLE001 - a class that cannot run here is judged on its shapes alone
        return None
    finally:
        hook.remove()
    if "io" not in got or got["io"][0] is None or got["io"][1] is None:
        return None
    x, y = (t.double() for t in got["io"])
    if not bool(torch.isfinite(x).all() and torch.isfinite(y).all()):
        return None  # nothing to measure on (a class not yet fully set up)
    w1, b1, w2, b2 = weights
    scale = float(y.abs().max()) or 1.0
    return {name: float(((f(x @ w1.t() + b1) @ w2.t() + b2) - y).abs().max()) / scale
            for name, f in ACTIVATIONS.items()}


def _mlp_weights(model: nn.Module, lay: UserLayout):
    """Block 0's MLP weights (out, in) and biases (zeros where the class has none), in float64."""
    params = dict(model.named_parameters(remove_duplicate=False))
    found = {a.target: a for a in lay.assignments if a.target and a.target.startswith("blocks.0.mlp.")}
    out = []
    for layer in ("fc", "proj"):
        w = found.get(f"blocks.0.mlp.{layer}.weight")
        if w is None:
            return None
        weight = params[w.param].detach().double()
        weight = weight.t() if w.transform.name == "transpose" else weight
        b = found.get(f"blocks.0.mlp.{layer}.bias")
        bias = params[b.param].detach().double() if b else weight.new_zeros(weight.shape[0])
        out += [weight, bias]
    return out
