"""The MLP's activation, measured on weights chosen for the purpose: block 0's MLP module is run once with its own
code and probe weights put in place of its parameters (torch.func.functional_call; the class's Parameters are not
touched), so that its hidden units receive pre-activations spread over [-4, 4] and each output channel reads one
hidden unit back. Its output is then the activation itself at known points, whatever values the class was built
with: a class whose MLP output projection starts at zero, or whose small init keeps every pre-activation near
zero, is measured as surely as a trained one. GPT-2 uses the tanh approximation of GELU; a class with ReLU, ReLU²
or SiLU is a different architecture, and one with the exact (erf) GELU computes GPT-2 only approximately (the two
GELUs part by up to 4.7e-4 on this grid, fp32 computes them to ~1e-6)."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from dataclasses import dataclass

from gpt2port.activations import DISTINCT, TABLE
from gpt2port.userclass.calls import calls_for
from gpt2port.userclass.layout import UserLayout
from gpt2port.userclass.observe import device_of, evaluating, first_tensor
from gpt2port.verification.reference import ACTIVATIONS as FORMULAS  # the float64 reference's own, by HF name

GPT2, ERF = "gelu_new", "gelu"
# every activation a config can hold (activations.py's table), and two that none can, by what they are called
ACTIVATIONS = {**{name: FORMULAS[name] for name in DISTINCT},
               "ReLU²": lambda x: FORMULAS["relu"](x).square(),
               "no activation": lambda x: x}
SPAN = 4.0  # the probe's pre-activations lie in [-SPAN, SPAN]
TOLERANCE = 2e-5  # absolute, on values of at most SPAN (SPAN² for ReLU²): far below the GELUs' 4.7e-4 gap


@torch.no_grad()
def measure(model: nn.Module, lay: UserLayout) -> dict[str, float] | None:
    """The largest absolute error of each known activation in explaining block 0's MLP on the probe, or None where
    it cannot be measured (the MLP is not a module of its own, holds more than its two layers, or cannot run)."""
    mods = lay.modules
    if not mods.mlp:
        return in_run(model, lay)
    prefix = f"{mods.block(0)}.{mods.mlp}"
    module = model.get_submodule(prefix)
    probe = _probe_weights(module, prefix, lay)
    if probe is None:
        return in_run(model, lay)
    values, points, width = probe
    x = torch.zeros(1, 1, width)
    x[..., 0] = 1.0  # the probe's fc reads channel 0 only: its hidden units see exactly `points`
    try:
        with torch.random.fork_rng(devices=[]), evaluating(module):
            y = first_tensor(functional_call(module, values, (x,), strict=False))
    except Exception:  # noqa: BLE001 - a module that cannot run alone is judged by the load's proof instead
        return None
    if y is None or y.shape[-1] != width:
        return None
    y = y.reshape(-1, y.shape[-1])[0, : points.numel()].double()
    if not bool(torch.isfinite(y).all()):
        return None
    return {name: float((f(points) - y).abs().max()) for name, f in ACTIVATIONS.items()}


class _Seen(Exception):
    """The MLP's activation output is captured: the rest of the forward is not needed."""


def in_run(model: nn.Module, lay: UserLayout) -> dict[str, float] | None:
    """measure()'s errors, read from block 0 as the model runs it (calls.py), wherever its activation is computed
    (a module inside a Sequential beside the LayerNorm, a function such as nn.TransformerEncoderLayer's, a line in
    the forward): the MLP's first layer returns the probe's pre-activations, and what reaches its second layer is
    the activation of them. None where the two layers are not modules of their own, or block 0 is not seen."""
    found = {a.target: a.param.rsplit(".", 1)[0] for a in lay.assignments
             if a.target in ("blocks.0.mlp.fc.weight", "blocks.0.mlp.proj.weight")}
    if len(found) != 2 or any(p.is_meta for p in model.parameters()):
        return None
    fc, proj = (model.get_submodule(found[f"blocks.0.mlp.{k}.weight"]) for k in ("fc", "proj"))
    if fc is proj or len(list(fc.parameters())) > 2 or len(list(proj.parameters())) > 2:
        return None
    got = []

    def spread(m, args, out):
        if not isinstance(out, torch.Tensor):
            return None
        return torch.linspace(-SPAN, SPAN, out.shape[-1], dtype=out.dtype, device=out.device).expand(out.shape)

    def read(m, args):
        got.append(first_tensor(args))
        raise _Seen

    dtype = next(model.parameters()).dtype
    x = torch.randn(1, 4, lay.config.n_embd, generator=torch.Generator().manual_seed(0)).to(dtype)
    hooks = [fc.register_forward_hook(spread), proj.register_forward_pre_hook(read)]
    try:
        with torch.random.fork_rng(devices=[]), evaluating(model):
            calls_for(model, lay).run(0, x.to(device_of(model)))
    except _Seen:
        pass
    except Exception:  # noqa: BLE001 - user code: measured by the proof of the whole class instead
        return None
    finally:
        for h in hooks:
            h.remove()
    if not got or got[0] is None:
        return None
    y = got[0].reshape(-1, got[0].shape[-1])[0].double().cpu()
    points = torch.linspace(-SPAN, SPAN, y.numel(), dtype=torch.float64)
    if not bool(torch.isfinite(y).all()):
        return None
    return {name: float((f(points) - y).abs().max()) for name, f in ACTIVATIONS.items()}


def said(name: str) -> str:
    return TABLE[name].words if name in TABLE else name


@dataclass
class Measured:
    """What block 0's MLP computes: `name`, the table's name (None where no config can hold it), in `words`."""
    name: str | None
    words: str
    err: float


def identify(model: nn.Module, lay: UserLayout) -> Measured | None:
    """The one measurement of a class's activation, for load_into and save_from alike; None where the MLP cannot
    be run apart (the proof of the whole class judges it then)."""
    errors = measure(model, lay)
    if errors is None:
        return None
    best = min(errors, key=errors.get)
    if errors[best] <= TOLERANCE:
        return Measured(best if best in TABLE else None, f"measures as {said(best)}", errors[best])
    return Measured(None, f"matches no known activation (closest: {said(best)}, off by {errors[best]:.2g})",
                    errors[best])


def _probe_weights(module: nn.Module, prefix: str, lay: UserLayout):
    """{local name: probe tensor} for the MLP module's fc and proj (weights and biases, in the class's layout),
    the pre-activation points output channel c reads back, and the model width; None where the module holds
    anything else or a weight's layout cannot be matched."""
    found = {a.target: a for a in lay.assignments if a.target and a.target.startswith("blocks.0.mlp.")}
    fc, proj = found.get("blocks.0.mlp.fc.weight"), found.get("blocks.0.mlp.proj.weight")
    own = dict(module.named_parameters(remove_duplicate=False))
    if fc is None or proj is None:
        return None
    local = {a.param: a.param[len(prefix) + 1:] for a in found.values()}
    if any(not a.param.startswith(prefix + ".") for a in found.values()) or set(own) - set(local.values()):
        return None  # the MLP module holds its LayerNorm or other parameters: its output is not fc-act-proj alone
    hidden, width = _canonical_shape(own[local[fc.param]], fc)
    if hidden < 2 or width < 2:
        return None
    n = min(width, hidden)
    hit = torch.linspace(0, hidden - 1, n).round().long()  # the hidden units read back, one per output channel
    points = torch.zeros(hidden, dtype=torch.float64)
    points[hit] = torch.linspace(-SPAN, SPAN, n, dtype=torch.float64)
    w1 = torch.zeros(hidden, width)
    w1[:, 0] = points.float()
    w2 = torch.zeros(width, hidden)
    w2[torch.arange(n), hit] = 1.0
    values = {}
    for a, w in ((fc, w1), (proj, w2)):
        t = _in_layout(own[local[a.param]], a, w)
        if t is None:
            return None
        values[local[a.param]] = t
    for a in found.values():  # biases (and anything else GPT-2 puts in the MLP) at zero
        if local[a.param] not in values:
            values[local[a.param]] = torch.zeros(own[local[a.param]].shape)
    return values, points[hit], width


def _canonical_shape(p: torch.Tensor, a) -> tuple[int, int]:
    shape = tuple(a.transform.canonical_shape(tuple(p.shape)))
    return (shape[0], shape[1]) if len(shape) == 2 else (0, 0)


def _in_layout(p: torch.Tensor, a, canonical: torch.Tensor) -> torch.Tensor | None:
    """`canonical` as the class stores this parameter (its transform, else its transpose where only that fits)."""
    try:
        t = a.transform.to_layout(canonical)
    except Exception:  # noqa: BLE001 - a transform that does not apply to this shape
        t = None
    if t is None or tuple(t.shape) != tuple(p.shape):
        t = canonical.t() if tuple(canonical.t().shape) == tuple(p.shape) else None
    return None if t is None else t.contiguous()
