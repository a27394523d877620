"""Why a stage differs: the usual from-scratch mistakes, each confirmed by measurement, never guessed.

When localization finds the first stage of a model that differs from the float64 reference, that stage is re-run
in the reference with each known mistake made on purpose (exact-erf GELU, another LayerNorm eps, unbiased
variance, no 1/sqrt(d) scaling, a causal mask off by one, positions counted from 1, q and k swapped) on the same
input; the model is also re-run in eval mode when it was left in training mode. A mistake is named only when the
model's output then matches, to the stage's own tolerance: the report shows the error without it and with it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch

from gpt2port.verification import history
from gpt2port.verification.metrics import max_errors
from gpt2port.verification.reference import Float64GPT2, Stage, layer_norm
from gpt2port.verification.reference_canonical import hf_key

LN_EPS = (1e-6, 1e-12, 1e-8, 1e-3, 0.0)  # eps values seen in the wild (and none at all)


@dataclass(frozen=True)
class Suspect:
    name: str
    part: str  # the stage it shows in: embeddings, attention, mlp, final_norm
    advice: str
    # (reference, the stage's weights, its input, the layer, the input's ids) -> the stage's output with the mistake
    run: Callable
    activation: str | None = None  # the MLP activation this mistake is (activations.py's name; "typo": none known)


def _ln(ln: str, eps=None, unbiased=False):
    """A LayerNorm of block/final weights `ln` with a changed eps or variance."""
    def norm(ref: Float64GPT2, w: dict, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, w[f"{ln}.weight"], w[f"{ln}.bias"], ref.config.eps if eps is None else eps, unbiased)
    return norm


def _attention(norm=_ln("ln_1"), **change):
    return lambda ref, w, x, layer, ids: ref.attention(norm(ref, w, x), w, layer, **change)


def _mlp(norm=_ln("ln_2"), activation=None):
    return lambda ref, w, x, layer, ids: ref.mlp(norm(ref, w, x), w, activation)


def _final(norm):
    return lambda ref, w, x, layer, ids: norm(ref, w, x)


def _mlp_act(act):
    """GPT-2's MLP with another activation (one the float64 reference does not name: typed out wrong, ReLU²)."""
    def run(ref, w, x, layer, ids):
        h = _ln("ln_2")(ref, w, x) @ w["mlp.c_fc.weight"] + w["mlp.c_fc.bias"]
        return act(h) @ w["mlp.c_proj.weight"] + w["mlp.c_proj.bias"]
    return run


def _gelu_tanh(c: float):
    return lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + c * x.pow(3))))


ACT_ADVICE = "GPT-2's MLP activation is the tanh GELU: nn.GELU(approximate='tanh')"


def _positions_from_1(ref: Float64GPT2, w, x, layer, ids):
    """wte[ids] + wpe[1:T+1]; an input filling the whole context has no row for its last position, which gets the
    last row (a model counting from 1 could not run it at all)."""
    wpe = torch.cat([w["wpe"], w["wpe"][-1:]]).to(torch.float64)
    return w["wte"][ids].to(torch.float64) + wpe[1:ids.shape[-1] + 1]


def _block(kind: str):
    """GPT-2's block put together otherwise, from its own attention, MLP and LayerNorms."""
    def run(ref, w, x, layer, ids):
        ln1, ln2 = (lambda h: _ln("ln_1")(ref, w, h)), (lambda h: _ln("ln_2")(ref, w, h))
        attn, mlp = (lambda h: ref.attention(h, w, layer)), (lambda h: ref.mlp(h, w))
        if kind == "parallel":
            return x + attn(ln1(x)) + mlp(ln2(x))
        if kind == "normed":
            h = ln1(x)
            h = ln2(h + attn(h))
            return h + mlp(h)
        if kind == "mlp_first":
            y = x + mlp(ln2(x))
            return y + attn(ln1(y))
        y = ln1(x + attn(x))  # post-LN: each sub-layer on the stream, the sum normalised
        return ln2(y + mlp(y))
    return run


_BLOCK_ADVICE = "GPT-2's block: x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))"
# the block's parts put together otherwise: named where the whole block is explained by one (part "block")
STRUCTURES = [
    Suspect("attention and MLP in parallel: both read the block's input (GPT-NeoX/GPT-J style), GPT-2's MLP reads "
            "the stream after the attention's addition", "block", _BLOCK_ADVICE, _block("parallel")),
    Suspect("the residual added from the normed input (x = ln(x) + attn(ln(x))), not from the stream itself",
            "block", _BLOCK_ADVICE, _block("normed")),
    Suspect("the MLP before the attention", "block", _BLOCK_ADVICE, _block("mlp_first")),
    Suspect("post-LN: the LayerNorms after each residual addition, GPT-2 normalises before each sub-layer", "block",
            _BLOCK_ADVICE, _block("post_ln")),
]


def _suspects(stated_eps=()) -> list[Suspect]:
    eps_advice = "set the LayerNorm's eps to 1e-5, as GPT-2 (nn.LayerNorm(C, eps=1e-5))"
    var_advice = "use the biased variance in LayerNorm: x.var(dim=-1, keepdim=True, unbiased=False)"
    out = [
        Suspect("exact (erf) GELU instead of GPT-2's tanh approximation", "mlp",
                "use nn.GELU(approximate='tanh') (GPT-2's GELU is 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))))",
                _mlp(activation="gelu"), "gelu"),
        Suspect("attention scores not divided by sqrt(head_dim)", "attention",
                "divide q @ k^T by sqrt(head_dim) before the softmax", _attention(scale=1.0)),
        Suspect("attention scores divided by sqrt(n_embd) instead of sqrt(head_dim)", "attention",
                "divide by sqrt(head_dim) = sqrt(n_embd / n_head)",
                lambda ref, w, x, layer, ids: ref.attention(_ln("ln_1")(ref, w, x), w, layer,
                                                            scale=1.0 / math.sqrt(ref.config.n_embd))),
        Suspect("causal mask off by one: each position also sees the next", "attention",
                "mask with torch.tril(torch.ones(T, T)): position t attends to 0..t", _attention(mask_shift=1)),
        Suspect("causal mask off by one: a position does not see itself", "attention",
                "mask with torch.tril(torch.ones(T, T)) (diagonal kept): position t attends to 0..t",
                _attention(mask_shift=-1)),
        Suspect("q and k swapped", "attention",
                "q is the first third of GPT-2's c_attn (W_query), k the second (W_key)", _attention(swap_qk=True)),
        Suspect("positions counted from 1", "embeddings", "position ids are torch.arange(0, T)", _positions_from_1),
        Suspect("ReLU instead of GPT-2's GELU", "mlp", ACT_ADVICE, _mlp_act(torch.relu), "relu"),
        Suspect("ReLU² (squared ReLU) instead of GPT-2's GELU", "mlp", ACT_ADVICE,
                _mlp_act(lambda x: torch.relu(x).square()), "ReLU²"),
        Suspect("SiLU instead of GPT-2's GELU", "mlp", ACT_ADVICE, _mlp_act(lambda x: x * torch.sigmoid(x)), "silu"),
        Suspect("GELU's constant typed 0.44715 instead of 0.044715", "mlp",
                "0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))), or nn.GELU(approximate='tanh')",
                _mlp_act(_gelu_tanh(0.44715)), "typo"),
        Suspect("the final LayerNorm is never applied (defined, but not called in forward)", "final_norm",
                "call it on the last block's output before the head: x = self.ln_f(x)",
                lambda ref, w, x, layer, ids: x),
        *STRUCTURES,
    ]
    for part, ln, wrap in (("attention", "ln_1", _attention), ("mlp", "ln_2", _mlp), ("final_norm", "ln_f", _final)):
        out.append(Suspect("LayerNorm with unbiased variance", part, var_advice, wrap(_ln(ln, unbiased=True))))
        out += [Suspect(f"LayerNorm eps {eps:g} instead of GPT-2's 1e-5", part, eps_advice, wrap(_ln(ln, eps=eps)))
                for eps in _eps_tried(stated_eps)]
    return out


def _eps_tried(stated) -> list[float]:
    """The eps the model states (its LayerNorms' own eps) first, then those seen in the wild."""
    return list(dict.fromkeys([e for e in stated if e != 1e-5] + list(LN_EPS)))


def _eps_named(stated) -> set[str]:
    """The names of the eps suspects the model itself states: where fp32 cannot tell two eps apart (1e-8 and
    1e-12 both explain a stage to its tolerance), the one the model states is named, as measured."""
    return {f"LayerNorm eps {e:g} instead of GPT-2's 1e-5" for e in stated if e != 1e-5}


SUSPECTS = _suspects()


def _error(pairs) -> float:
    """Relative error over inputs; positions where both sides are NaN (a fully masked row) agree."""
    clean = []
    for o, r in pairs:
        o = o.to(torch.float64)
        if bool((torch.isnan(o) ^ torch.isnan(r)).any()):
            return float("inf")
        both = torch.isnan(o) & torch.isnan(r)
        clean.append((torch.where(both, 0.0, o), torch.where(both, 0.0, r)))
    rel = max_errors(clean)[1]
    return float("inf") if math.isnan(rel) else rel


def _from_history(h: dict, part: str, layer) -> Callable | None:
    """The stage re-run as the model's recorded history says it computes (history.py), or None where that event
    does not touch this stage."""
    if h["event"] == history.ERF_GELU and part == "mlp":
        return _mlp(activation="gelu")
    if h["event"] == history.DROPPED_BIASES and part in ("attention", "mlp") and layer is not None:
        prefix = f"h.{layer}."
        sub = "attn." if part == "attention" else "mlp."
        keys = [k[len(prefix):] for k in map(hf_key, h["canonical"]) if k and k.startswith(prefix + sub)]
        if not keys:
            return None
        run = _attention() if part == "attention" else _mlp()
        return lambda ref, w, x, layer, ids: run(ref, {**w, **{k: torch.zeros_like(w[k]) for k in keys}}, x, layer,
                                                 ids)
    return None


def non_finite(named) -> list[str]:
    """The names of the (name, tensor) pairs holding NaN or Inf. Nothing computed from such a weight can match GPT-2,
    so this is checked before any mistake is sought."""
    from gpt2port.conversion import all_finite

    return [name for name, t in named if t.is_floating_point() and not all_finite(t.detach())]


def non_finite_parameters(module) -> list[str]:
    """A model's parameters holding NaN or Inf, and its float buffers holding NaN (a mask buffer may hold -inf)."""
    bad = non_finite(module.named_parameters())
    return bad + [name for name, b in module.named_buffers() if b.is_floating_point() and bool(b.isnan().any())]


def describe_non_finite(names: list[str], whose: str) -> str:
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"NaN or Inf in {whose} weights: {shown}; nothing computed from them can match GPT-2"


@torch.no_grad()
def contradicted(s: Suspect, activation: str | None, stated_eps=()) -> bool:
    """Whether the class itself says a suspect is not it: its MLP activation was measured as another function
    (`activation`: activations.py's name, "unknown" where it matched none, None where it was not measured), or
    every LayerNorm eps it states is GPT-2's 1e-5."""
    if s.activation is not None and activation is not None:
        return s.activation != activation and not (s.activation == "typo" and activation == "unknown")
    if s.name.startswith("LayerNorm eps") and stated_eps:
        return all(e == 1e-5 for e in stated_eps)
    return False


def diagnose(ref: Float64GPT2, st: Stage, part: str, xs: list, ours: list, tol: float, ids: list,
             rerun_in_eval: Callable[[], list] | None = None, events=(), stated_eps=(),
             activation: str | None = None) -> dict:
    """The known mistake that explains the first differing stage, measured.

    xs: the reference's input of that stage per input (ids for the embeddings); ours: the model's output on them;
    rerun_in_eval: the model's outputs again with the model in eval mode, when it was training; events: the model's
    recorded history (history.py), consulted first: what it says the model computes is re-run and measured;
    stated_eps: the eps its LayerNorms state, named where they explain the stage as well as another eps does."""
    refs = st.values["out"] if part == "embeddings" else st.values.get({"attention": "attn", "mlp": "mlp",
                                                                         "final_norm": "out", "block": "out"}[part])
    before = _error(list(zip(ours, refs)))
    prefix = "" if st.layer is None else f"h.{st.layer}."
    bad = non_finite((prefix + k if "." in k else f"{k}.weight", w) for k, w in st.weights.items())
    if bad:  # the reference's own weights: no mistake of ours can explain what they compute
        return {"stage": part, "rel_before": before, "tolerance": tol, "explained_by": None, "advice": None,
                "rel_with": None, "closest": None, "measured_against": None, "tried": [], "non_finite": bad}
    for h in events:
        run = _from_history(h, part, st.layer)
        if run is None:
            continue
        rel = _error(list(zip(ours, [run(ref, st.weights, x, st.layer, i) for x, i in zip(xs, ids)])))
        if rel <= tol:
            return {"stage": part, "rel_before": before, "tolerance": tol, "explained_by": h["line"], "advice": None,
                    "rel_with": rel, "closest": h["line"], "history": True,
                    "measured_against": "against the reference computing what the history says",
                    "tried": [{"mistake": h["line"], "rel": rel, "on": "every input"}]}
    tried = []
    if rerun_in_eval is not None:
        tried.append(("dropout active: the model was left in training mode", "call model.eval() before checking or "
                      "generating", _error(list(zip(rerun_in_eval(), refs))), "with the model re-run in eval mode",
                      True))
    # Screened on the smallest input (a full-context input at 124M takes seconds per candidate); the two best are then
    # measured on every input, and only those measurements can explain the stage.
    small = min(range(len(xs)), key=lambda k: xs[k].numel())
    screened = []
    stated = _eps_named(stated_eps)
    for s in (s for s in (_suspects(stated_eps) if stated_eps else SUSPECTS)
              if s.part == part and not contradicted(s, activation, stated_eps)):
        alt = s.run(ref, st.weights, xs[small], st.layer, ids[small])
        screened.append((_error([(ours[small], alt)]), s))
    screened.sort(key=lambda t: t[0])
    for k, (rel, s) in enumerate(screened):
        full = k < 2 or s.name in stated
        if full:
            alt = [s.run(ref, st.weights, x, st.layer, i) for x, i in zip(xs, ids)]
            rel = _error(list(zip(ours, alt)))
        tried.append((s.name, s.advice, rel, "against the reference making that mistake", full))
    tried += _scaled(part, ours, refs)
    tried.sort(key=lambda t: t[2])
    best = min((t for t in tried if t[4]), key=lambda t: t[2], default=None)
    own = next((t for t in tried if t[4] and t[0] in stated and t[2] <= tol), None)
    if own is not None and best is not None and best[2] <= tol and "LayerNorm eps" in best[0]:
        best = own
    explained = best is not None and best[2] <= tol
    tuned = next((h for h in events if h["event"] == history.FINETUNED), None)
    if not explained and tuned is not None:  # nothing measured explains it; what the weights went through does
        return {"stage": part, "rel_before": before, "tolerance": tol, "explained_by": tuned["line"],
                "advice": None, "rel_with": None, "closest": None, "measured_against": None, "history": True,
                "tried": [{"mistake": name, "rel": rel, "on": "every input" if full else "the smallest input"}
                          for name, _, rel, _, full in tried]}
    return {"stage": part, "rel_before": before, "tolerance": tol,
            "explained_by": best[0] if explained else None, "advice": best[1] if explained else None,
            "rel_with": best[2] if best else None, "closest": best[0] if best else None,
            "measured_against": best[3] if best else None, "history": False,
            "tried": [{"mistake": name, "rel": rel, "on": "every input" if full else "the smallest input"}
                      for name, _, rel, _, full in tried]}


def _scaled(part: str, ours: list, refs: list) -> list[tuple]:
    """A sub-layer whose output is GPT-2's times a constant (a residual branch scaled before it is added), with the
    constant fitted by least squares over every input and then measured like any mistake."""
    if part not in ("attention", "mlp") or not refs or refs[0] is None:
        return []
    o = [t.to(torch.float64) for t in ours]
    num = sum(float((a * r).sum()) for a, r in zip(o, refs))
    den = sum(float((r * r).sum()) for r in refs)
    if not den or not math.isfinite(num):
        return []
    c = num / den
    said = " (1/sqrt(2))" if abs(c - 0.5 ** 0.5) < 1e-3 else ""
    what = "attention" if part == "attention" else "MLP"
    return [(f"the {what}'s output multiplied by {c:.4g}{said} before it is added to the residual stream",
             f"add the {what}'s output to the residual stream as it is: x = x + {part}(ln(x))",
             _error([(a, c * r) for a, r in zip(o, refs)]), "against GPT-2's output times that constant", True)]


def describe(d: dict) -> str:
    if d.get("nondeterministic") is not None:
        return (f"the forward is not deterministic in eval mode: two runs on one input differ (rel "
                f"{d['nondeterministic']:.2e}): dropout? (F.dropout or scaled_dot_product_attention's dropout_p "
                f"applied whatever self.training is)")
    if d.get("non_finite"):
        return describe_non_finite(d["non_finite"], "the reference's")
    if d.get("history"):
        measured = f" (rel {d['rel_with']:.2e} {d['measured_against']})" if d["rel_with"] is not None else ""
        return f"{d['explained_by']}{measured}"
    if d["explained_by"]:
        return (f"explained by: {d['explained_by']} (rel {d['rel_before']:.2e} against GPT-2; {d['rel_with']:.2e} "
                f"{d['measured_against']}); fix: {d['advice']}")
    closest = f"; closest: {d['closest']} ({d['rel_with']:.2e})" if d["closest"] else ""
    return f"no known mistake explains it ({len(d['tried'])} tried{closest})"


@contextlib.contextmanager
def eval_mode(module):
    """The module in eval mode for the duration; each submodule's own mode restored afterwards."""
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        yield module
    finally:
        for m, mode in modes.items():
            m.training = mode
