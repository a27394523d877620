"""Reading a user's class as GPT-2: which parameter is which GPT-2 tensor, told from the module itself.

Shapes say what a tensor can be ((3C, C) a fused q|k|v projection, (4C, C) the MLP's first layer, (C/H, C) one
head's q, k or v); module types say how a weight is stored (nn.Linear (out, in), HF's Conv1D (in, out)); the order
modules ran in on a short input tells the first LayerNorm from the second and an output projection from q, k, v;
names tell q from k from v. What none of these decides is a Choice: every option is built, and settle.py runs each
against gpt2port's own GPT and keeps the one that computes GPT-2.
"""

from __future__ import annotations

import re

from torch import nn

from gpt2port.config import PRESETS, GPTConfig
from gpt2port.layouts import canonical
from gpt2port.layouts.transforms import IDENTITY, TRANSPOSE, AddDim, Chain
from gpt2port.userclass.block import Picker, block_template, for_block, norm_assignments
from gpt2port.userclass.layout import Assignment, CropRows, Modules, UserLayout
from gpt2port.userclass.names import says_position, HEAD_COUNT_ATTRS
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
    cfg = config or _own_config(model, tok, pos, kids, inner, C)
    lay = UserLayout(type(model).__name__, cfg, modules=Modules(blocks=blocks))
    V, P, L, H, F = cfg.vocab_size, cfg.n_positions, cfg.n_layer, cfg.n_head, cfg.mlp_width
    if tuple(tok[2].shape) != (V, C) or C != cfg.n_embd:
        lay.reasons.append(f"{tok[0].full(tok[1])}: token embedding is {tuple(tok[2].shape)}, GPT-2 needs ({V}, "
                           f"{cfg.n_embd}); build the class with {_config_words(cfg)}")
        if pos is not None and pos[2].shape[-2] != P:
            lay.reasons.append(f"{pos[0].full(pos[1])}: position table is {tuple(pos[2].shape)}, GPT-2 needs ({P}, "
                               f"{cfg.n_embd}) (or crop_positions=True for a shorter context)")
        # and whatever else keeps it from being a GPT-2 of any size, read at its own size
        own, _ = infer(model, _own_config(model, tok, pos, kids, inner, C), tr, options, crop)
        lay.reasons += own.reasons
        lay.modules, lay.missing_biases, lay.missing_bias_targets = own.modules, own.missing_biases, \
            own.missing_bias_targets
        lay.assignments = own.assignments  # never loaded (refused); read for measuring its activation
        return lay, pk
    lay.assignments.append(Assignment(tok[0].full(tok[1]), canonical.EMBEDDING))
    _positions(lay, pos, P, C, crop)
    _head(lay, tok, head, head_bias, same, V, C)
    lay.reasons += [f"{u.full(k)}: shape {tuple(p.shape)} matches no GPT-2 tensor outside the blocks"
                    for u, k, p in extra]
    if final is None:
        lay.reasons.append("no final LayerNorm with a weight and a bias of (width,) after the blocks "
                           "(a norm without learned parameters, or RMSNorm, is not GPT-2's)")
    else:
        lay.modules.final_norm = final.name
        lay.assignments += norm_assignments(pk, "final norm", final, "final_norm")
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
        lay.notes.append(f"{u.full(k)}: set to zero (GPT-2's head has no bias)")


def _own_config(model, tok, pos, kids, us, C) -> GPTConfig:
    """The GPT-2 a class is shaped as, when no checkpoint says (layout_of(model) alone)."""
    V = tok[2].shape[0]
    P = pos[2].shape[-2] if pos is not None else 1024
    H = None
    for m in model.modules():
        for attr in HEAD_COUNT_ATTRS:
            if isinstance(getattr(m, attr, None), int):
                H = getattr(m, attr)
                break
        if H:
            break
    mats = [tuple(p.shape) for u in us for p in u.params.values() if p.dim() == 2 and C in p.shape]
    per_head = [min(s) for s in mats if max(s) == C and min(s) < C and C % min(s) == 0]
    if (H is None or C % H) and per_head:  # one module per head: (C/H, C) weights tell H
        H = C // per_head[0]
    if H is None or C % H:
        H = next((p["n_head"] for p in PRESETS.values() if p["n_embd"] == C), 1)
    F = next((max(s) for s in mats if min(s) == C and max(s) not in (C, 3 * C)), 4 * C)
    return GPTConfig(n_layer=max(len(kids), 1), n_head=H, n_embd=C, vocab_size=V, n_positions=P,
                     n_inner=None if F == 4 * C else F)


def _config_words(cfg: GPTConfig) -> str:
    return (f"vocab_size={cfg.vocab_size}, n_positions={cfg.n_positions} (context), n_embd={cfg.n_embd}, "
            f"n_layer={cfg.n_layer}, n_head={cfg.n_head}")



def layout_of(model: nn.Module, config: GPTConfig | str | None = None) -> UserLayout:
    """How gpt2port reads `model` as GPT-2, as a printable table. config: the GPT-2 to read it as (a GPTConfig, a
    size name such as "gpt2-medium", or a checkpoint/source path); default: the one the class's shapes imply.
    Choices that only a checkpoint's numbers can settle are listed as undecided."""
    from gpt2port.config import is_known_name

    if isinstance(config, str) and is_known_name(config):
        config = GPTConfig.preset(config)
    elif config is not None and not isinstance(config, GPTConfig):
        from gpt2port.sources import open_source, source_path

        with open_source(source_path(config)) as src:
            config = src.config
    lay, pk, _ = read_class(model, config)
    lay.decided += [f"undecided until loaded: {n} ({' | '.join(labels)})" for n, labels in pk.choices.items()]
    return lay


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
