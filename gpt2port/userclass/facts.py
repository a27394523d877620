"""What a class is, measured rather than guessed: its head count, its MLP's activation, its LayerNorm eps (and the
choices names and shapes leave open), for a class that no checkpoint was loaded into.

The class's own first block is run in float64 beside gpt2port's block under each candidate, both with weights at
a trained GPT-2's scales swapped in for the duration (q/k and MLP pre-activations of std ~2: at the 0.02 init every
head count gives nearly uniform attention, and erf and tanh GELU agree to 1e-7); the candidate that computes the
same block is the fact. The class's own weights are put back as they were; what they are (fresh init, zeros, a
trained model's) does not matter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from gpt2port.activations import words
from gpt2port.config import GPTConfig
from gpt2port.layouts import canonical
from gpt2port.userclass.calls import calls_for
from gpt2port.userclass.layout import UserLayout
from gpt2port.userclass.names import HEAD_COUNT_ATTRS
from gpt2port.userclass.observe import evaluating, first_tensor

TOL = {torch.float64: 1e-9, torch.float32: 1e-5}  # a candidate computes the class's block within this (relative)
# ... or within the class's own precision: a float64 class may hold float32 constants (2^-24 ~ 6e-8 each)
CLASS_TOL = {torch.float64: 1e-7, torch.float32: 1e-5, torch.float16: 3e-2}
EPS_SEEN = (1e-5, 1e-6, 1e-12, 1e-8, 1e-3)  # LayerNorm eps found in the wild, tried where the class states none
PROBE_TOKENS = 8


@dataclass
class Found:
    """The facts measured, and how well the class's block matched gpt2port's under them."""
    n_head: int
    activation: str
    eps: float
    options: dict
    layout: UserLayout
    rel: float
    tried: int


@dataclass
class Missed:
    """No reading computes the class's block 0: why, and the closest reading (None where block 0 did not run)."""
    why: str
    closest: Found | None


def head_hints(model: nn.Module) -> list[int]:
    """Head counts the class states: an attribute (n_head, num_heads, ...) on one of its modules, or a key of a
    config it keeps (a dict, dataclass or namespace: self.cfg["n_heads"], self.config.num_heads). Most common
    first."""
    seen: dict[int, int] = {}

    def note(v):
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            seen[v] = seen.get(v, 0) + 1

    for m in model.modules():
        for attr in HEAD_COUNT_ATTRS:
            note(getattr(m, attr, None))
        for value in vars(m).values():
            if isinstance(value, (nn.Module, torch.Tensor)):
                continue
            fields = value if isinstance(value, dict) else getattr(value, "__dict__", None)
            if isinstance(fields, dict):
                for attr in HEAD_COUNT_ATTRS:
                    note(fields.get(attr))
    return sorted(seen, key=lambda h: -seen[h])


def stated_eps(model: nn.Module, lay: UserLayout) -> list[float]:
    """The eps the class's LayerNorms keep (nn.LayerNorm.eps, or a hand-written norm's self.eps), block 0's and the
    final norm's."""
    out = []
    names = [f"{lay.modules.block(0)}.{rel}" for rel in (lay.modules.ln1, lay.modules.ln2) if rel]
    for name in names + ([lay.modules.final_norm] if lay.modules.final_norm else []):
        eps = getattr(model.get_submodule(name), "eps", None)
        if isinstance(eps, float) and eps not in out:
            out.append(eps)
    return out


def eps_hints(model: nn.Module, lay: UserLayout) -> list[float]:
    """The eps the class's LayerNorms keep, then GPT-2's."""
    out = stated_eps(model, lay)
    return out + [e for e in (lay.config.layer_norm_epsilon, 1e-5) if e not in out]


def divisors_first(hints: list[int], C: int) -> list[int]:
    """Head counts to try: the stated ones, then every divisor of the width (the likely ones first)."""
    rest = sorted((h for h in range(1, C + 1) if C % h == 0), key=lambda h: (abs(math.log2(C / h) - 6), h))
    return [h for h in hints if C % h == 0] + [h for h in rest if h not in hints]


def probe_state(lay: UserLayout, seed: int = 0) -> dict[str, torch.Tensor]:
    """Block 0's canonical tensors at a trained GPT-2's scales (float64); GPT-2's biases the class lacks are 0."""
    cfg = lay.config
    C, F = cfg.n_embd, cfg.mlp_width
    g = torch.Generator().manual_seed(seed)
    std = {"ln1.weight": None, "ln2.weight": None, "ln1.bias": 0.1, "ln2.bias": 0.1,
           "attn.qkv.weight": 2.5 / math.sqrt(C), "attn.qkv.bias": 0.3, "attn.proj.weight": 0.5 / math.sqrt(C),
           "attn.proj.bias": 0.05, "mlp.fc.weight": 2.5 / math.sqrt(C), "mlp.fc.bias": 0.5,
           "mlp.proj.weight": 0.5 / math.sqrt(F), "mlp.proj.bias": 0.05}
    out = {}
    for name, shape in canonical.shapes(dataclasses.replace(cfg, n_layer=1)).items():
        if not name.startswith("blocks.0."):
            continue
        short = name.removeprefix("blocks.0.")
        s = std[short]
        t = torch.randn(shape, generator=g, dtype=torch.float64)
        out[name] = (1 + 0.3 * t).clamp(0.3, 1.9) if s is None else t * s
        if name.replace("blocks.0.", "blocks.{}.") in lay.missing_bias_targets:
            out[name].zero_()
    return out


@contextlib.contextmanager
def _probe_weights(model: nn.Module, lay: UserLayout, state: dict, dtype):
    """Block 0 itself, its parameters and floating buffers swapped for `state` (through the layout) in `dtype` on
    the CPU for the duration, and put back as they were (the very same tensors) after. Not a copy: a block's
    forward may reach its modules through closures that a copy would still share with the original. Yields None
    where it cannot be probed (buffers without values, a parameter the layout cannot fill)."""
    prefix = lay.modules.block(0)
    block = model.get_submodule(prefix)
    if any(b.is_meta for b in block.buffers()):
        yield None
        return
    saved = []
    try:
        for m in block.modules():
            for k, p in m._parameters.items():
                if p is not None:
                    saved.append((m._parameters, k, p))
                    m._parameters[k] = nn.Parameter(torch.zeros(p.shape, dtype=dtype), requires_grad=False)
            for k, b in m._buffers.items():
                if b is not None:
                    saved.append((m._buffers, k, b))
                    m._buffers[k] = b.to(device="cpu", dtype=dtype if b.is_floating_point() else b.dtype)
        with torch.no_grad():
            for a in lay.assignments:
                if a.param.startswith(prefix + "."):
                    p = block.get_parameter(a.param[len(prefix) + 1:])
                    value = torch.zeros_like(p) if a.target is None else a.transform.to_layout(state[a.target])
                    if tuple(value.shape) != tuple(p.shape):
                        yield None
                        return
                    p.copy_(value)
        with torch.random.fork_rng(devices=[]), evaluating(block):
            yield block
    finally:
        for table, k, t in reversed(saved):
            table[k] = t


def _reference(cfg: GPTConfig, state: dict, dtype) -> nn.Module:
    from gpt2port.model import Block

    with torch.device("meta"):
        block = Block(cfg)
    block.load_state_dict({k.removeprefix("blocks.0."): v.to(dtype) for k, v in state.items()}, assign=True)
    return block.eval()


def _observed(model: nn.Module, lay: UserLayout, x: torch.Tensor):
    """run(x): block 0 on x with what the model passes it (calls.py), or None where no run of the model shows it
    (then the block is called with x alone)."""
    calls = calls_for(model, lay)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), evaluating(model):
            calls.run(0, x.to(next(model.parameters()).dtype))
    except Exception:  # noqa: BLE001 - user code: unobserved
        return None
    return lambda y: calls.run(0, y)


def class_tolerance(block: nn.Module) -> float:
    """How far a float64 probe of the class may sit from gpt2port's block and still be it: the precision the class
    computes in. A float32 constant in its code (`torch.sqrt(torch.tensor(2.0 / torch.pi))`) stays float32 inside
    the probe: that is the class's own rounding (~1e-9 relative here), not another function."""
    dtype = next((p.dtype for p in block.parameters() if p.is_floating_point()), torch.float32)
    return CLASS_TOL.get(dtype, CLASS_TOL[torch.float16])


@torch.no_grad()
def measure(model: nn.Module, lay: UserLayout, heads: list[int], activations: list[str], eps: list[float],
            build: Callable[[dict], UserLayout] | None = None, combos: list[dict] | None = None) -> Found | Missed:
    """The (options, head count, activation, eps) under which gpt2port's block computes the class's block 0, judged
    at the class's own precision (class_tolerance); among the activations and eps of the first head count that
    matches, the closest, earlier ones (the class's own statements) winning ties. Else Missed: why none was found,
    and the closest reading."""
    state = probe_state(lay)
    C = lay.config.n_embd
    x = torch.randn(1, PROBE_TOKENS, C, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    best, tried, why = (math.inf, None), 0, "block 0 could not be run apart from the model"
    if not stated_eps(model, lay):  # a norm that keeps no eps (F.layer_norm inline): those seen in the wild too
        eps = list(dict.fromkeys(list(eps) + list(EPS_SEEN)))
    calls = None
    for opts in combos or [{}]:
        cand = build(opts) if build is not None else lay
        if cand.reasons:
            continue
        if calls is None:  # block 0 runs with what the model passes it (a mask, positions): seen once, as it runs
            calls = _observed(model, cand, x)
        got, own = None, class_tolerance(model.get_submodule(cand.modules.block(0)))  # before the probe's swap
        for dtype in (torch.float64, torch.float32):
            try:
                with _probe_weights(model, cand, state, dtype) as block:
                    if block is None:
                        break
                    tol = max(TOL[dtype], own)
                    got = first_tensor(calls(x.to(dtype)) if calls else block(x.to(dtype)))
                    got = got.detach().to(torch.float64) if got is not None else None
            except Exception as e:  # noqa: BLE001 - user code: float64 may not suit it; float32 is tried next
                why = f"block 0 did not run on its own ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                continue
            if got is not None and tuple(got.shape) == tuple(x.shape):
                break
            why, got = "block 0 does not return a (batch, tokens, width) tensor", None
        if got is None:
            continue
        scale = float(got.abs().max()) or 1.0
        for h in heads:
            rels = {}
            for act in activations:
                for e in eps:
                    cfg = dataclasses.replace(cand.config, n_layer=1, n_head=h, activation=act, layer_norm_epsilon=e,
                                              dropout=0.0)
                    rels[act, e] = float((_reference(cfg, state, torch.float64)(x) - got).abs().max()) / scale
                    tried += 1
            low = min(rels.values())
            if low <= tol:  # the first reading (stated ones come first) within twice the best: rounding cannot tell
                # some apart (eps 1e-8 and 1e-12), and then what the class states is what it computes
                act, e = next(k for k, r in rels.items() if r <= max(2 * low, low + 1e-12))
                return Found(h, act, e, opts, cand, rels[act, e], tried)
            if low < best[0]:
                act, e = min(rels, key=rels.get)
                best = (low, (h, act, e, opts, cand))
    if best[1] is None:
        return Missed(why, None)
    h, act, e, opts, cand = best[1]
    return Missed(f"block 0 computes none of GPT-2's blocks (closest: n_head={h}, {words(act)}, eps {e:g}, off "
                  f"by {best[0]:.2g} relative; {tried} tried)", Found(h, act, e, opts, cand, best[0], tried))
