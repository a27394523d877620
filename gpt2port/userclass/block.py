"""One block of a user's class as GPT-2's block: two LayerNorms, attention (fused q|k|v, separate q, k, v, or one
module per head) with its output projection, and the MLP's two layers, each weight with the bias GPT-2 gives it.

Block 0 is read; every other block must have the same parameters under the same names (checked), and gets block
0's rows with its own index.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from gpt2port.layouts.transforms import IDENTITY, TRANSPOSE, Chain, Part
from gpt2port.userclass.layout import Assignment, UserLayout
from gpt2port.userclass.names import HEAD_COUNT_ATTRS, norm_role, role_of, stem
from gpt2port.userclass.observe import Trace, Unit, first_tensor

ORIENT = ["(out, in), as nn.Linear stores it", "(in, out), as HF's Conv1D stores it"]
QKV = ("q", "k", "v")


class Picker:
    """Options for the choices met while reading a class: `pick` returns the option asked for (default the first,
    the most likely) and records the choice, so that every combination can be built and tried."""

    def __init__(self, options: dict[str, int] | None = None):
        self.options, self.choices = dict(options or {}), {}

    def pick(self, name: str, labels: list[str]) -> int:
        if len(labels) == 1:
            return 0
        self.choices[name] = labels
        return self.options.get(name, 0)

    def combinations(self, limit: int = 96) -> list[dict[str, int]]:
        names = list(self.choices)
        combos = itertools.product(*(range(len(self.choices[n])) for n in names))
        return [dict(zip(names, c)) for c in itertools.islice(combos, limit)]

    def describe(self, options: dict[str, int]) -> list[str]:
        return [f"{n}: {self.choices[n][options.get(n, 0)]}" for n in self.choices]


@dataclass
class Lin:
    """A weight matrix and its bias, in the unit that holds them."""
    unit: Unit
    weight: str
    bias: str | None
    stored: tuple[int, ...]
    style: str | None  # "linear", "conv", or None: the module does not say
    shape: tuple[int, ...] = ()  # (out, in), once the orientation is known

    @property
    def name(self) -> str:
        return self.unit.full(self.weight)

    def words(self) -> tuple[str, ...]:
        return (self.unit.name.rsplit(".", 1)[-1], stem(self.weight))

    def label(self) -> str:
        if len(self.unit.params) > 2:
            return self.weight
        bits = self.unit.name.split(".")
        return ".".join(bits[-2:]) if bits[-1].isdigit() else bits[-1]  # 'lin.0' rather than '0'



def norm_assignments(pk: Picker, what: str, u: Unit, prefix: str, lay: UserLayout | None = None) -> list[Assignment]:
    """A LayerNorm's two (C,) parameters: which scales and which shifts, by name, or else a choice. A LayerNorm
    without a bias (one parameter) scales, and lacks GPT-2's shift as a Linear without a bias lacks its bias."""
    if len(u.params) == 1:
        if lay is not None:
            lay.missing_biases.append(u.name)
            lay.missing_bias_targets.add(f"{prefix}.bias")
        return [Assignment(u.full(next(iter(u.params))), f"{prefix}.weight")]
    a, b = list(u.params)
    ra, rb = norm_role(a), norm_role(b)
    if ra == "bias" or rb == "weight":
        a, b = b, a
    elif ra is None and rb is None:
        if pk.pick(f"{what}: which parameter scales", [f"{a} scales, {b} shifts", f"{b} scales, {a} shifts"]):
            a, b = b, a
    return [Assignment(u.full(a), f"{prefix}.weight"), Assignment(u.full(b), f"{prefix}.bias")]


def scale_only_norm(u: Unit) -> str | None:
    """What a module with a single (C,) parameter is: "layernorm" (it subtracts the mean: a LayerNorm built without
    a bias), "rms" (it does not: RMSNorm), or None where it cannot be run apart (its values are not there)."""
    m = u.module
    if isinstance(m, nn.LayerNorm):
        return "layernorm"
    if isinstance(m, getattr(nn, "RMSNorm", ())):
        return "rms"
    p = next(iter(u.params.values()))
    if p.is_meta or not p.is_floating_point():
        return None
    x = torch.randn(2, 4, p.shape[0], generator=torch.Generator().manual_seed(0)).to(p.device, p.dtype)
    try:
        with torch.no_grad():
            a, b = first_tensor(m(x)), first_tensor(m(x + 3))
    except Exception:  # noqa: BLE001 - a module that cannot run on its own is judged by its parameters alone
        return None
    if a is None or b is None or a.shape != x.shape:
        return None
    tol = 1e-3 if p.dtype in (torch.float32, torch.float64) else 3e-2
    return "layernorm" if float((a - b).abs().max()) <= tol * (float(a.abs().max()) or 1.0) else "rms"


def scale_only_reason(u: Unit, kind: str | None) -> str:
    if kind == "rms":
        return (f"{u.name}: a norm that scales without subtracting the mean (RMSNorm); GPT-2's LayerNorm subtracts "
                f"the mean, then scales and shifts")
    return f"{u.name}: a norm with a scale only; GPT-2's LayerNorm subtracts the mean, then scales and shifts"


def block_template(lay: UserLayout, pk: Picker, us: list[Unit], prefix: str, tr: Trace, rank, C: int, H: int,
                   F: int, block: nn.Module) -> list[Assignment]:
    """Block 0's rows (targets with '{}' for the layer)."""
    norms, lins, said_norms = [], [], False
    for u in us:
        mats = {k: p for k, p in u.params.items() if p.dim() == 2}
        vecs = {k: p for k, p in u.params.items() if p.dim() == 1}
        odd = [k for k, p in u.params.items() if p.dim() not in (1, 2)]
        lay.reasons += [f"{u.full(k)}: a {u.params[k].dim()}-D parameter; GPT-2's blocks hold matrices and vectors"
                        for k in odd]
        if not mats:
            if len(vecs) == 2 and all(p.shape[0] == C for p in vecs.values()):
                norms.append(u)
            elif len(vecs) == 1 and next(iter(vecs.values())).shape[0] == C:
                kind = scale_only_norm(u)
                if kind == "layernorm":  # a LayerNorm built with bias=False: it lacks a bias, as a Linear can
                    norms.append(u)
                else:
                    lay.reasons.append(scale_only_reason(u, kind))
                    said_norms = True
            else:
                lay.reasons += [f"{u.full(k)}: shape {tuple(p.shape)} matches no GPT-2 tensor" for k, p in vecs.items()]
            continue
        lins += _pair(lay, u, mats, vecs, tr)
    if not norms and not said_norms:
        lay.reasons.append(f"{prefix}: no LayerNorm with a weight and a bias (a norm without learned parameters, "
                           f"or RMSNorm, is not GPT-2's)")
    rows = []
    norms.sort(key=lambda u: rank(u.name))
    if len(norms) == 2:
        lay.modules.ln1, lay.modules.ln2 = (_rel(prefix, u.name) for u in norms)
        rows += norm_assignments(pk, "block LayerNorm 1", norms[0], "blocks.{}.ln1", lay)
        rows += norm_assignments(pk, "block LayerNorm 2", norms[1], "blocks.{}.ln2", lay)
        if tr.error:
            lay.notes.append(f"the forward pass could not be traced ({tr.error}); the LayerNorms are taken in the "
                             f"order they are defined")
    elif norms:
        lay.reasons.append(f"{prefix}: {len(norms)} LayerNorms, GPT-2's blocks have 2")
    undecided = [x for x in lins if x.style is None]
    flip = pk.pick("how weights without nn.Linear are stored", ORIENT) if undecided else 0
    for x in lins:
        if x.style is None:
            x.style = ("linear", "conv")[flip]
        x.shape = x.stored if x.style == "linear" else tuple(reversed(x.stored))
    D = C // H
    kinds = {"qkv": [], "sq": [], "head": [], "fc": [], "proj": []}
    for x in lins:
        kind = {(3 * C, C): "qkv", (C, C): "sq", (F, C): "fc", (C, F): "proj"}.get(x.shape)
        if kind is None and x.shape == (D, C):
            kind = "head"
        if kind is None:
            lay.reasons.append(f"{x.name}: a {x.stored} weight matches no GPT-2 tensor (width {C}, MLP {F}, "
                               f"{H} heads of {D})")
        else:
            kinds[kind].append(x)
    rows += _attention(lay, pk, kinds, prefix, rank, C, H)
    if len(kinds["fc"]) == 1 and len(kinds["proj"]) == 1:
        fc, proj = kinds["fc"][0], kinds["proj"][0]
        rows += _rows(lay, fc, "blocks.{}.mlp.fc", IDENTITY)
        rows += _rows(lay, proj, "blocks.{}.mlp.proj", IDENTITY)
        lay.modules.mlp = _common(prefix, [fc.unit.name, proj.unit.name])
        lay.modules.mlp_out = _output_module(prefix, proj)
    else:
        lay.reasons.append(f"{prefix}: the MLP needs one ({F}, {C}) and one ({C}, {F}) weight; found "
                           f"{len(kinds['fc'])} and {len(kinds['proj'])}")
    _check_heads(lay, block, H, prefix)
    return rows


def _pair(lay: UserLayout, u: Unit, mats: dict, vecs: dict, tr: Trace) -> list[Lin]:
    """Each matrix of a unit with its bias: the unit's one vector, or the vector whose name says the same thing."""
    out = []
    free = dict(vecs)
    for k, p in mats.items():
        if len(mats) == 1:
            bias = next(iter(free), None) if len(free) == 1 else None
        else:  # the vector the forward adds to this weight's product, else the one named for it
            bias = next((b for b in free if tr.pairs.get(id(free[b])) == id(p)), None) or \
                next((b for b in free if _bias_of(b, k)), None)
        if bias is not None and free[bias].shape[0] not in p.shape:
            bias = None
        free_size = free.pop(bias).shape[0] if bias is not None else None
        style = _style(u, k, tuple(p.shape), tr, len(mats) == 1)
        if style is None and bias is not None and p.shape[0] != p.shape[1]:  # a bias is as long as the output
            style = "linear" if free_size == p.shape[0] else "conv"
        out.append(Lin(u, k, bias, tuple(p.shape), style))
    lay.reasons += [f"{u.full(k)}: a vector of {tuple(p.shape)} that belongs to no weight" for k, p in free.items()]
    return out


def _bias_of(b: str, w: str) -> bool:
    """Whether vector `b` is named as the bias of matrix `w`: 'W_query'/'b_query', 'w1'/'b1', 'c_attn_w'/'c_attn_b',
    'proj'/'proj_bias'."""
    if stem(b) and stem(b) == stem(w):
        return True
    if b in (w + "_b", w + "_bias", w + "b", w.replace("weight", "bias")):
        return True
    if w[:1] in "wW" and b[:1] in "bB" and b[1:] == w[1:]:
        return True
    return role_of(b) is not None and role_of(b) == role_of(w)  # bias_q, b_q, q_bias with W_query


def _style(u: Unit, local: str, shape, tr: Trace, alone: bool) -> str | None:
    m = u.module
    if isinstance(m, nn.Linear) and local == "weight":
        return "linear"
    if hasattr(m, "nf") and local == "weight":  # transformers' Conv1D keeps its output width in `nf`
        return "conv"
    d_in = tr.in_dim.get(u.name)
    if alone and d_in is not None and shape[0] != shape[1]:
        return "linear" if shape[1] == d_in else "conv" if shape[0] == d_in else None
    return None


def _attention(lay: UserLayout, pk: Picker, kinds: dict, prefix: str, rank, C: int, H: int) -> list[Assignment]:
    fused, sq, heads = kinds["qkv"], kinds["sq"], kinds["head"]
    if len(fused) == 1 and len(sq) == 1 and not heads:
        lay.modules.attn = _common(prefix, [fused[0].unit.name, sq[0].unit.name])
        lay.modules.attn_out = _output_module(prefix, sq[0])
        return _rows(lay, fused[0], "blocks.{}.attn.qkv", IDENTITY) + _rows(lay, sq[0], "blocks.{}.attn.proj", IDENTITY)
    if not fused and len(sq) == 4 and not heads:
        proj, qkv = _split_proj(pk, sq, rank)
        roles = _roles(pk, "which of q, k, v is which", [qkv], rank)
        rows = []
        for x, j in zip(qkv, roles[0]):
            rows += _rows(lay, x, "blocks.{}.attn.qkv", Part(j, 3))
        lay.modules.attn = _common(prefix, [x.unit.name for x in sq])
        lay.modules.attn_out = _output_module(prefix, proj)
        return rows + _rows(lay, proj, "blocks.{}.attn.proj", IDENTITY)
    if not fused and len(sq) == 1 and len(heads) == 3 * H:
        groups: dict[str, list[Lin]] = {}
        for x in heads:  # one head's q, k and v share the module that holds them (or are its parameters)
            owner = x.unit.name if len(x.unit.params) > 2 else x.unit.name.rsplit(".", 1)[0]
            groups.setdefault(owner, []).append(x)
        if len(groups) != H or any(len(g) != 3 for g in groups.values()):
            lay.reasons.append(f"{prefix}: {len(heads)} per-head weights that do not group into {H} heads of q, k, v")
            return []
        order = sorted(groups, key=lambda n: (_index(n), rank(n)))
        roles = _roles(pk, "which of each head's q, k, v is which", [groups[n] for n in order], rank)
        rows = []
        for h, (name, role) in enumerate(zip(order, roles)):
            for x, j in zip(groups[name], role):
                rows += _rows(lay, x, "blocks.{}.attn.qkv", Part(j * H + h, 3 * H))
        lay.modules.attn = _common(prefix, [x.unit.name for x in heads + sq])
        lay.modules.attn_out = _output_module(prefix, sq[0])
        return rows + _rows(lay, sq[0], "blocks.{}.attn.proj", IDENTITY)
    lay.reasons.append(f"{prefix}: attention needs a fused ({3 * C}, {C}) q|k|v weight, or q, k, v of ({C}, {C}), or "
                       f"{H} heads of ({C // H}, {C}) each, plus an output projection ({C}, {C}); found "
                       f"{len(fused)} fused, {len(sq)} square, {len(heads)} per-head")
    return []


def _split_proj(pk: Picker, sq: list[Lin], rank) -> tuple[Lin, list[Lin]]:
    """The output projection among four square weights: by name, else the one that ran last, else a choice."""
    named = [x for x in sq if role_of(*x.words()) == "proj"]
    if len(named) != 1:
        last_first = sorted(sq, key=lambda x: rank(x.unit.name), reverse=True)
        named = [last_first[pk.pick("which square weight is the attention's output projection",
                                    [x.name for x in last_first])]]
    proj = named[0]
    return proj, [x for x in sq if x is not proj]


def _roles(pk: Picker, what: str, groups: list[list[Lin]], rank) -> list[list[int]]:
    """For each group of three weights, the index (0 q, 1 k, 2 v) each holds: by name when names say all three;
    else a choice over the orders, the run order first (the same choice for every group)."""
    said = [[role_of(*x.words()) for x in g] for g in groups]
    if all(sorted(s, key=str) == sorted(QKV) for s in said):
        return [[QKV.index(r) for r in s] for s in said]
    perms = list(itertools.permutations(range(3)))
    by_run = [sorted(range(3), key=lambda i: rank(g[i].unit.name)) for g in groups]
    # the most likely order first: in the order they run, q then k then v
    first = [0] * 3
    for j, i in enumerate(by_run[0]):
        first[i] = j
    perms.remove(tuple(first))
    perms.insert(0, tuple(first))
    labels = [", ".join(f"{x.label()}={QKV[j]}" for x, j in zip(groups[0], p)) for p in perms]
    p = perms[pk.pick(what, labels)]
    return [list(p) for _ in groups]


def _rows(lay: UserLayout, x: Lin, prefix: str, part) -> list[Assignment]:
    orient = TRANSPOSE if x.style == "conv" else IDENTITY
    weight = part if orient is IDENTITY else orient if part is IDENTITY else Chain(part, orient)
    rows = [Assignment(x.name, f"{prefix}.weight", weight)]
    if x.bias is not None:
        rows.append(Assignment(x.unit.full(x.bias), f"{prefix}.bias", part))
    else:
        lay.missing_biases.append(x.unit.name if len(x.unit.params) == 1 else x.name)
        lay.missing_bias_targets.add(f"{prefix}.bias")
    return rows


def _output_module(prefix: str, x: Lin) -> str | None:
    """The module of a sub-layer's last projection, when it holds nothing else (an nn.Linear): its output is the
    sub-layer's contribution to the residual stream, which verify can read even where attention or the MLP is
    written inline in the block's forward."""
    return _rel(prefix, x.unit.name) if len(x.unit.params) <= 2 and x.unit.name != prefix else None


def _check_heads(lay: UserLayout, block: nn.Module, H: int, prefix: str) -> None:
    """A head count the class keeps (on its attention module, usually) that differs from the checkpoint's: every
    shape fits, but the heads would be cut in the wrong places."""
    for name, m in block.named_modules():
        for attr in HEAD_COUNT_ATTRS:
            n = getattr(m, attr, None)
            if isinstance(n, int) and not isinstance(n, bool) and n != H:
                where = f"{prefix}.{name}" if name else prefix
                lay.reasons.append(f"{where}.{attr} = {n}; GPT-2 has {H} heads: build the class with n_head={H}")


def _index(name: str) -> int:
    tail = name.rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def _rel(prefix: str, name: str) -> str:
    return name[len(prefix) + 1:] if name.startswith(prefix + ".") else ""


def _common(prefix: str, names: list[str]) -> str | None:
    """The innermost module holding all of `names`, relative to the block; None if that is the block itself."""
    parts = [_rel(prefix, n).split(".") for n in names]
    common = []
    for bits in zip(*parts):
        if len(set(bits)) != 1:
            break
        common.append(bits[0])
    return ".".join(common) or None


def for_block(lay: UserLayout, template: list[Assignment], first: str, prefix: str, i: int,
              params: dict) -> list[Assignment]:
    """Block 0's rows for block i, each checked to exist with the same shape."""
    out = []
    for a in template:
        name = prefix + a.param[len(first):]
        if name not in params:
            lay.reasons.append(f"{name}: missing (blocks differ from {first})")
            continue
        out.append(Assignment(name, a.target.format(i) if a.target else None, a.transform, a.note))
    return out
