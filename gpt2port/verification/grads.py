"""Gradient parity, the training counterpart of logit parity: on the same batch, the loss and the gradient of every
parameter of gpt2port's GPT against transformers' GPT2LMHeadModel, in fp32.

Both models see the same ids; ours predicts ids[:, 1:] from ids[:, :-1], transformers shifts labels=ids itself, so
the two losses are the same mean over the same positions. The tied embedding's gradient is the sum of its two uses
(lookup and head) in both. Transformers' gradients are mapped to gpt2port's names through the HF layout table (the
same table convert uses), Conv1D transposes included. One model is in memory at a time, plus ours' gradients.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Callable

import torch

from gpt2port.errors import GPT2PortError
from gpt2port.layouts import HF

# max |Δgrad| / max |grad| per parameter, fp32: 10x the largest measured (1.1e-6 at 124M on 2x32 random ids;
# 2.9e-7 on the tiny model), as the logit tolerances are set.
TOLERANCE = 1e-5


def gradient_parity(load_ours: Callable, ref_path: Path, ids: torch.Tensor) -> dict:
    """{"loss_ours", "loss_hf", "loss_rel", "max_rel", "worst", "params"} for one (B, T) batch of ids."""
    try:
        import transformers
    except ImportError:
        raise GPT2PortError("gradient parity needs transformers (pip install 'gpt2port[reference]')") from None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    ours = load_ours().float().eval()
    config = ours.config
    ours.zero_grad(set_to_none=True)
    _, loss_ours = ours(ids[:, :-1], targets=ids[:, 1:])
    loss_ours.backward()
    mine_loss = float(loss_ours.detach())
    grads = {name: p.grad.detach().clone() for name, p in ours.named_parameters()}  # the tied head: once
    del ours, loss_ours
    gc.collect()
    directory = ref_path if ref_path.is_dir() else ref_path.parent
    hf = transformers.GPT2LMHeadModel.from_pretrained(directory, local_files_only=True).float().eval()
    out = hf(ids, labels=ids)
    out.loss.backward()
    theirs = dict(hf.named_parameters())
    worst, max_rel = None, 0.0
    for w in HF.plan_write(config):
        g = theirs[w.key].grad
        mine = w.transform.to_layout(grads[w.source])
        scale = float(g.abs().max()) or 1.0
        rel = float((mine - g).abs().max()) / scale
        if worst is None or rel > max_rel:
            worst, max_rel = w.source, rel
    loss_hf = float(out.loss.detach())
    return {"loss_ours": mine_loss, "loss_hf": loss_hf, "loss_rel": abs(mine_loss - loss_hf) / abs(loss_hf),
            "max_rel": max_rel, "worst": worst, "params": len(grads), "tolerance": TOLERANCE}
