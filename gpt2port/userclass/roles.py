"""Reading a user's class as GPT-2: which parameter is which GPT-2 tensor, told from the module itself.

Shapes say what a tensor can be ((3C, C) a fused q|k|v projection, (4C, C) the MLP's first layer, (C/H, C) one
head's q, k or v); module types say how a weight is stored (nn.Linear (out, in), HF's Conv1D (in, out)); the order
modules ran in on a short input tells the first LayerNorm from the second and an output projection from q, k, v;
names tell q from k from v. What none of these decides is a Choice: every option is built, and settle.py runs each
against gpt2port's own GPT and keeps the one that computes GPT-2.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

from torch import nn

from gpt2port.config import GPTConfig
from gpt2port.layouts import canonical
from gpt2port.layouts.transforms import IDENTITY, TRANSPOSE, AddDim, Chain
from gpt2port.userclass.block import (Picker, block_template, for_block, norm_assignments, scale_only_norm,
                                      scale_only_reason)
from gpt2port.userclass.layout import Assignment, CropRows, Modules, Note, UserLayout
from gpt2port.activations import DISTINCT, words
from gpt2port.userclass.activation import identify
from gpt2port.userclass.facts import Missed, divisors_first, eps_hints, head_hints, measure
from gpt2port.userclass.names import says_position
from gpt2port.userclass.observe import Trace, Unit, aliases, probe_ids, trace, units


def infer(model: nn.Module, config: GPTConfig | None, tr: Trace, options: dict[str, int] | None = None,
          crop: bool = False) -> tuple[UserLayout, Picker]:
    """The class's layout (with reasons it cannot hold GPT-2, if any) under the given choices."""
    pk = Picker(options)
    us = units(model)
    same = aliases(model)
    order = {u.name: i for i, u in enumerate(us)}
    rank = lambda name: tr.rank(name, order.get(name, 0))  # noqa: E731  run order, else registration order
    blocks, kids = _find_blocks(model)
    inside = re.compile(rf"^{re.escape(blocks)}\.[^.]+\.") if kids else None
    outside = [u for u in us if not (inside and inside.match(u.name + "."))]

    tok, pos, head, head_bias, final, extra = _top(outside, same, rank)
    if tok is None:
        lay = UserLayout(type(model).__name__, config or GPTConfig())
        lay.reasons.append("no token embedding: no 2-D parameter outside the blocks looks like one (vocab, width)")
        return lay, pk
    C = tok[2].shape[1]
    inner = [u for u in us if u not in outside]
    own, unknown = _own_config(model, tok, pos, kids, inner, C)
    cfg = config or own
    lay = UserLayout(type(model).__name__, cfg, modules=Modules(blocks=blocks), unknown=[] if config else unknown)
    V, P, L, H, F = cfg.vocab_size, cfg.n_positions, cfg.n_layer, cfg.n_head, cfg.mlp_width
    if tuple(tok[2].shape) != (V, C) or C != cfg.n_embd:
        lay.reasons.append(f"{tok[0].full(tok[1])}: token embedding is {tuple(tok[2].shape)}, GPT-2 needs ({V}, "
                           f"{cfg.n_embd}); build the class with {_config_words(cfg)}")
        if pos is not None and pos[2].shape[-2] != P:
            lay.reasons.append(f"{pos[0].full(pos[1])}: position table is {tuple(pos[2].shape)}, GPT-2 needs ({P}, "
                               f"{cfg.n_embd}) (or crop_positions=True for a shorter context)")
        # and whatever else keeps it from being a GPT-2 of any size, read at its own size
        own, _ = infer(model, _own_config(model, tok, pos, kids, inner, C)[0], tr, options, crop)
        lay.reasons += own.reasons
        lay.modules, lay.missing_biases, lay.missing_bias_targets = own.modules, own.missing_biases, \
            own.missing_bias_targets
        lay.assignments = own.assignments  # never loaded (refused); read for measuring its activation
        return lay, pk
    lay.assignments.append(Assignment(tok[0].full(tok[1]), canonical.EMBEDDING))
    _positions(lay, pos, P, C, crop)
    _head(lay, tok, head, head_bias, same, V, C)
    if final is None:  # a norm of one (C,) parameter after the blocks: a LayerNorm without a bias, or RMSNorm
        alone = [x for x in extra if len(x[0].params) == 1 and tuple(x[2].shape) == (C,)]
        kind = scale_only_norm(alone[0][0]) if len(alone) == 1 else None
        if len(alone) == 1:
            extra.remove(alone[0])
            if kind == "layernorm":
                final = alone[0][0]
            else:
                lay.reasons.append(scale_only_reason(alone[0][0], kind))
    lay.reasons += [f"{u.full(k)}: shape {tuple(p.shape)} matches no GPT-2 tensor outside the blocks"
                    for u, k, p in extra]
    if final is None:
        if not any(r.endswith("then scales and shifts") for r in lay.reasons):
            lay.reasons.append("no final LayerNorm with a weight and a bias of (width,) after the blocks "
                               "(a norm without learned parameters, or RMSNorm, is not GPT-2's)")
    else:
        lay.modules.final_norm = final.name
        lay.assignments += norm_assignments(pk, "final norm", final, "final_norm", lay)
    if not kids:
        lay.reasons.append("no stack of blocks (a ModuleList, Sequential or ModuleDict of identical modules)")
        return lay, pk
    if len(kids) != L:
        lay.reasons.append(f"{blocks}: {len(kids)} blocks, GPT-2 has {L}; build the class with {_config_words(cfg)}")
        return lay, pk
    block_units = [u for u in us if u.name.startswith(f"{blocks}.{kids[0]}.") or u.name == f"{blocks}.{kids[0]}"]
    first = f"{blocks}.{kids[0]}"
    template = block_template(lay, pk, block_units, first, tr, rank, C, H, F, model.get_submodule(first))
    params = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    for i, kid in enumerate(kids):
        lay.assignments += for_block(lay, template, f"{blocks}.{kids[0]}", f"{blocks}.{kid}", i, params)
    return lay, pk


# --- outside the blocks ------------------------------------------------------------------------------------------

def _find_blocks(model: nn.Module) -> tuple[str, list[str]]:
    """The container whose children are identical modules holding the most parameters: the block stack."""
    best, best_size = ("", []), 0
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            continue
        kids = [(k, c) for k, c in m.named_children() if any(True for _ in c.parameters())]
        if not kids or len({type(c) for _, c in kids}) != 1:
            continue
        shapes = [sorted((n, tuple(p.shape)) for n, p in c.named_parameters()) for _, c in kids]
        if any(s != shapes[0] for s in shapes) or (len(kids) == 1 and not _looks_like_block(kids[0][1])):
            continue
        size = sum(p.numel() for _, c in kids for p in c.parameters())
        if size > best_size:
            best, best_size = (name, [k for k, _ in kids]), size
    return best


def _looks_like_block(m: nn.Module) -> bool:
    return sum(1 for p in m.parameters() if p.dim() == 2) >= 2


def _top(outside: list[Unit], same: dict, rank):
    """(token embedding, positions, untied head, head bias, final norm unit, unexplained) outside the blocks; each
    parameter as (unit, local name, parameter)."""
    flat = [(u, k, p) for u in outside for k, p in u.params.items()]
    seen, params = set(), []
    for u, k, p in flat:  # a tied parameter once, under its first name
        if id(p) not in seen:
            seen.add(id(p))
            params.append((u, k, p))
    mats = [x for x in params if x[2].dim() == 2]
    # the token table: the one a head is tied to, else not named for positions, else the one with most rows
    embeds = sorted((x for x in mats if isinstance(x[0].module, nn.Embedding)),
                    key=lambda x: (len(same[id(x[2])]) < 2, says_position(x[0].full(x[1])), -x[2].shape[0]))
    tok = embeds[0] if embeds else max(mats, key=lambda x: (x[2].shape[0], -rank(x[0].name)[0]), default=None)
    if tok is None:
        return None, None, None, None, None, params
    C, V = tok[2].shape[1], tok[2].shape[0]
    rest = [x for x in params if x is not tok]
    head = next((x for x in rest if x[2].dim() == 2 and sorted(x[2].shape) == sorted((V, C))), None)
    if head is not None and isinstance(head[0].module, nn.Embedding) and not isinstance(tok[0].module, nn.Embedding):
        tok, head = head, tok
    rest = [x for x in rest if x is not head]
    table = [x for x in rest if x[2].shape[-1] == C and (x[2].dim() == 2 or (x[2].dim() == 3 and x[2].shape[0] == 1))]
    pos = next((x for x in table if isinstance(x[0].module, nn.Embedding)), table[0] if table else None)
    rest = [x for x in rest if x is not pos]
    head_bias = next((x for x in rest if x[2].dim() == 1 and x[2].shape[0] == V), None)
    rest = [x for x in rest if x is not head_bias]
    final = None
    for u in outside:
        own = [(k, p) for k, p in u.params.items() if p.dim() == 1 and p.shape[0] == C and any(p is x[2] for x in rest)]
        if len(own) == 2 and len(u.params) == 2:
            final = u
    rest = [x for x in rest if final is None or x[0] is not final]
    return tok, pos, head, head_bias, final, rest


def _positions(lay: UserLayout, pos, P: int, C: int, crop: bool) -> None:
    if pos is None:
        lay.reasons.append(f"no learned position table of ({P}, {C}): positions computed otherwise (rotary, "
                           f"sinusoidal) are not GPT-2's")
        return
    u, k, p = pos
    rows = p.shape[-2]
    add = AddDim() if p.dim() == 3 else None
    steps = []
    if rows > P:
        lay.reasons.append(f"{u.full(k)}: {rows} positions, the checkpoint has {P}; build the class with "
                           f"a context (block size) of {P}")
        return
    if rows < P:
        if not crop:
            lay.reasons.append(f"{u.full(k)}: {rows} positions, the checkpoint has {P}; build the class with a "
                               f"context of {P}, or pass crop_positions=True to keep the first {rows}")
            return
        steps.append(CropRows(rows))
        lay.notes.append(f"{u.full(k)}: kept the first {rows} of the checkpoint's {P} positions (crop_positions)")
    if add is not None:
        steps.append(add)
    t = steps[0] if len(steps) == 1 else Chain(*steps) if steps else IDENTITY
    lay.assignments.append(Assignment(u.full(k), canonical.POSITIONS, t))


def _head(lay: UserLayout, tok, head, head_bias, same, V: int, C: int) -> None:
    names = same[id(tok[2])]
    users = [n for n in names if n != tok[0].full(tok[1])]
    if head is not None:
        lay.tied, lay.head_param = False, head[0].full(head[1])
        lay.modules.head = head[0].name
        t = TRANSPOSE if tuple(head[2].shape) == (C, V) and V != C else IDENTITY
        lay.assignments.append(Assignment(lay.head_param, canonical.EMBEDDING, t, "untied: a copy of the token "
                                                                                  "embedding"))
    elif users:
        lay.modules.head = users[0].rsplit(".", 1)[0]
    if head_bias is not None:
        u, k, _ = head_bias
        lay.assignments.append(Assignment(u.full(k), None, note="GPT-2's head has no bias"))
        lay.notes.append(Note(f"{u.full(k)}: set to zero (GPT-2's head has no bias)",
                              f"{u.full(k)}: will be set to zero when GPT-2 is loaded (GPT-2's head has no bias)"))


def _own_config(model, tok, pos, kids, us, C) -> tuple[GPTConfig, list[str]]:
    """The GPT-2 a class is shaped as, when no checkpoint says (layout_of(model) alone), and the facts its shapes
    and attributes do not tell (["n_head"]: read as 1 until measured; see facts.py)."""
    V = tok[2].shape[0]
    P = pos[2].shape[-2] if pos is not None else 1024
    hints = [h for h in head_hints(model) if C % h == 0]
    H = hints[0] if hints else None
    mats = [tuple(p.shape) for u in us for p in u.params.values() if p.dim() == 2 and C in p.shape]
    per_head = [min(s) for s in mats if max(s) == C and min(s) < C and C % min(s) == 0]
    if H is None and per_head:  # one module per head: (C/H, C) weights tell H
        H = C // per_head[0]
    F = next((max(s) for s in mats if min(s) == C and max(s) not in (C, 3 * C)), 4 * C)
    return GPTConfig(n_layer=max(len(kids), 1), n_head=H or 1, n_embd=C, vocab_size=V, n_positions=P,
                     n_inner=None if F == 4 * C else F), [] if H else ["n_head"]


def _config_words(cfg: GPTConfig) -> str:
    return (f"vocab_size={cfg.vocab_size}, n_positions={cfg.n_positions} (context), n_embd={cfg.n_embd}, "
            f"n_layer={cfg.n_layer}, n_head={cfg.n_head}")



def layout_of(model: nn.Module, config: GPTConfig | str | None = None) -> UserLayout:
    """How gpt2port reads `model` as GPT-2, as a printable table. config: the GPT-2 to read it as (a GPTConfig, a
    size name such as "gpt2-medium", or a checkpoint/source path); default: the one the class is, its head count,
    activation and LayerNorm eps measured on a copy of its first block (facts.py). Choices that only a
    checkpoint's numbers can settle are listed as undecided."""
    config = as_config(config)
    if config is None:
        lay, pk, _ = own_layout(model)
    else:
        lay, pk, _ = read_class(model, config)
    lay.decided += [f"undecided until loaded: {n} ({' | '.join(labels)})" for n, labels in pk.choices.items()]
    lay.before_load = True
    return lay


def as_config(config) -> GPTConfig | None:
    """A GPTConfig from a GPTConfig, a size name or a checkpoint/source path (None stays None)."""
    from gpt2port.config import is_known_name

    if config is None or isinstance(config, GPTConfig):
        return config
    if isinstance(config, str) and is_known_name(config):
        return GPTConfig.preset(config)
    from gpt2port.sources import open_source, source_path

    with open_source(source_path(config)) as src:
        return src.config


FACTS = ("n_head", "activation", "layer_norm_epsilon")


def own_layout(model: nn.Module, config: GPTConfig | None = None, given: dict | None = None):
    """(layout, the choices still open, facts.Missed where the facts could not be measured, else None): the class
    read as the GPT-2 it is, without a checkpoint. Its head count, activation and LayerNorm eps (and every choice
    inside a block) are measured (facts.measure); `given` (n_head, activation, layer_norm_epsilon) are tried
    first, and a measurement that contradicts one is a reason."""
    given = {k: v for k, v in (given or {}).items() if k in FACTS}
    lay, pk, tr = read_class(model, config)
    if lay.reasons or not lay.modules.blocks:
        return lay, pk, None
    C = lay.config.n_embd
    stated = [] if "n_head" in lay.unknown else [lay.config.n_head]
    heads = divisors_first(([given["n_head"]] if "n_head" in given else []) + stated, C)
    measured = identify(model, lay)  # the MLP alone, as load_into measures it: its activation is tried first
    acts = ([given["activation"]] if "activation" in given else []) + \
        ([measured.name] if measured is not None and measured.name else []) + DISTINCT
    eps = ([given["layer_norm_epsilon"]] if "layer_norm_epsilon" in given else []) + eps_hints(model, lay)
    inside = {n: labels for n, labels in pk.choices.items() if not n.startswith("final norm")}
    combos = [dict(zip(inside, c)) for c in itertools.product(*(range(len(v)) for v in inside.values()))][:96]
    cfg = lay.config

    def build(opts):
        return infer(model, cfg, tr, opts)[0]

    found = measure(model, lay, heads, list(dict.fromkeys(acts)), list(dict.fromkeys(eps)), build, combos)
    if isinstance(found, Missed):
        lay.notes.append(f"not measured: {found.why}")
        return lay, pk, found
    wrong = [f"{k}={given[k]!r} was given, but block 0 computes GPT-2's block with {k}={v!r}"
             for k, v in (("n_head", found.n_head), ("activation", found.activation),
                          ("layer_norm_epsilon", found.eps)) if k in given and given[k] != v]
    new = found.layout
    new.config = dataclasses.replace(cfg, n_head=found.n_head, activation=found.activation,
                                     layer_norm_epsilon=found.eps)
    new.unknown, new.reasons = [], new.reasons + wrong
    to = "exactly" if found.rel == 0 else f"to {found.rel:.1g}"
    new.decided.append(f"n_head={found.n_head}, {words(found.activation)}, LayerNorm eps {found.eps:g}: "
                       f"measured (block 0, run with weights at a trained GPT-2's scales, computes gpt2port's block "
                       f"{to})")
    new.decided += [f"{n}: {inside[n][i]} (measured on block 0)" for n, i in found.options.items()]
    for n in inside:
        pk.choices.pop(n)
    return new, pk, None


def context(model: nn.Module, lay: UserLayout) -> int:
    """The positions the class takes: rows of its position table (the layout's config's, without one)."""
    rows = [a for a in lay.assignments if a.target == canonical.POSITIONS]
    return model.get_parameter(rows[0].param).shape[-2] if rows else lay.config.n_positions


def read_class(model: nn.Module, config: GPTConfig | None, crop: bool = False, run: bool = True):
    """(layout, its open choices, the trace): read once without running the class, for the context it takes,
    then again with the order its modules run in on an input that fits. run=False skips the second reading (a
    class on the meta device: on meta tensors PyTorch decomposes every op, seconds at 1.5B)."""
    lay, pk = infer(model, config, Trace(error="not run yet"), crop=crop)
    if not run:
        return lay, pk, None
    tr = trace(model, probe_ids(model, lay.config.vocab_size, min(8, context(model, lay))))
    lay, pk = infer(model, config, tr, crop=crop)
    return lay, pk, tr
