"""save_from: a user's class written back as a gpt2port checkpoint, through the layout's inverse.

Every parameter goes back through its transform (q, k and v parts, or one per head, merged into GPT-2's fused
projection; Conv1D-style weights transposed back). The head is never silently re-tied or dropped: an untied head
that still equals the token embedding is stored once, as GPT-2 stores it; one that differs (fine-tuned) is kept as
the checkpoint's own head. A bias GPT-2 does not have (a head bias) is dropped only while it is zero.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from gpt2port import checkpoint
from gpt2port.config import GPTConfig
from gpt2port.errors import GPT2PortError
from gpt2port.layouts import canonical
from gpt2port.layouts.transforms import merge
from gpt2port.userclass.layout import UserLayout
from gpt2port.userclass.load import loaded
from gpt2port.userclass.roles import layout_of


def canonical_state(model: nn.Module, lay: UserLayout) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """(the config the class is, its weights as GPT-2's canonical tensors)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    rows = {a.target: [] for a in lay.assignments}
    for a in lay.assignments:
        rows[a.target].append(a)
    for a in rows.pop(None, []):
        if bool(params[a.param].detach().ne(0).any()):
            raise GPT2PortError(f"{a.param}: is no longer zero; GPT-2 has no such bias ({a.note}), so a GPT-2 "
                                f"checkpoint cannot hold this model")
    config = lay.config
    pos = rows.get(canonical.POSITIONS)
    if pos:  # a class with a shorter context (crop_positions) is saved as the GPT-2 it is
        config = dataclasses.replace(config, n_positions=params[pos[0].param].shape[-2])
    head = [a for a in rows.get(canonical.EMBEDDING, []) + rows.pop(canonical.HEAD, []) if a.param == lay.head_param]
    if head:
        rows[canonical.EMBEDDING] = [a for a in rows[canonical.EMBEDDING] if a.param != lay.head_param]
    shapes = canonical.shapes(config)
    state = {}
    with torch.no_grad():
        for name, shape in shapes.items():
            if name not in rows:
                continue
            parts = [(a.transform, params[a.param].detach().cpu()) for a in rows[name]]
            state[name] = merge(parts, shape).contiguous()
        if head:
            h = head[0].transform.from_layout(params[lay.head_param].detach().cpu(), shapes[canonical.EMBEDDING])
            if not torch.equal(h, state[canonical.EMBEDDING]):
                config = dataclasses.replace(config, tie_word_embeddings=False)
                state[canonical.HEAD] = h.contiguous()
    missing = [k for k in canonical.shapes(config) if k not in state]
    if missing:
        raise GPT2PortError(f"{lay.model_name}: holds no {', '.join(missing[:4])}; it cannot be saved as GPT-2")
    return config, state


def save_from(model: nn.Module, out: str | Path, *, dtype=None, force: bool = False, config=None) -> Path:
    """Write a user's class (e.g. after fine-tuning) as a gpt2port checkpoint at `out`; `gpt2port export --to hf`
    then gives transformers a checkpoint. A model filled by load_into is read the way it was loaded (and carries
    that checkpoint's tokenizer and provenance); another is read with layout_of(model, config)."""
    report = loaded(model)
    lay = report.layout if report is not None else layout_of(model, config)
    if lay.reasons:
        raise GPT2PortError(f"{lay.model_name}: cannot be saved as GPT-2: {lay.reasons[0]}")
    undecided = [d for d in lay.decided if d.startswith("undecided")]
    if undecided:
        raise GPT2PortError(f"{lay.model_name}: {undecided[0]}; load it with gpt2port.load_into first, which settles "
                            f"this by running it")
    cfg, state = canonical_state(model, lay)
    origin = Path(report.source) if report is not None else None
    return checkpoint.save_state(state, cfg, Path(out), dtype=dtype, force=force,
                                 origin=origin if origin is not None and checkpoint.is_checkpoint(origin) else None,
                                 tokenizer_from=(origin if origin.is_dir() else origin.parent) if origin else None,
                                 kind=f"in-memory {lay.model_name}")

