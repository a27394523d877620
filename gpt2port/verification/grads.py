"""Gradient parity, the training counterpart of logit parity: on the same batch, the loss and the gradient of every
parameter of gpt2port's GPT against transformers' GPT2LMHeadModel, in fp32; or, without transformers (hf=False),
against the float64 reference's own (grads64.py).

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
from gpt2port.training import recompute

# max |Δgrad| / max |grad| per parameter, fp32: 10x the largest measured (1.1e-6 at 124M on 2x32 random ids;
# 2.9e-7 on the tiny model), as the logit tolerances are set.
TOLERANCE = 1e-5


def gradient_parity(load_ours: Callable, ref_path: Path, ids: torch.Tensor, hf: bool = True,
                    say: Callable[[str], None] = lambda s: None) -> dict:
    """{"reference", "loss_ours", "loss_ref", "loss_rel", "max_rel", "worst", "params", "tolerance"} for one (B, T)
    batch of ids ("loss_hf" too, the same as "loss_ref", where the reference is transformers)."""
    if not hf:
        return _against_float64(load_ours, ref_path, ids, say)
    try:
        import transformers
    except ImportError:
        raise GPT2PortError("gradient parity needs transformers (pip install 'gpt2port[reference]')") from None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    say("gradients: ours, then transformers")
    config, mine_loss, grads = _ours(load_ours, ids)
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
    return {"reference": "transformers", "loss_ours": mine_loss, "loss_ref": loss_hf, "loss_hf": loss_hf,
            "loss_rel": abs(mine_loss - loss_hf) / abs(loss_hf), "max_rel": max_rel, "worst": worst,
            "params": len(grads), "tolerance": TOLERANCE}


def _ours(load_ours: Callable, ids: torch.Tensor) -> tuple:
    """(ours' config, loss, gradients by parameter name) on the batch, the model freed before the reference runs."""
    ours = load_ours().float().eval()
    config = ours.config
    # every block's activations recomputed in the backward (the same gradients, bit for bit): at 124M on 2x1024
    # tokens the run's peak falls from 3.7 GB to 2.8 GB (docs/verify.md)
    recompute.attach(ours, len(ours.blocks))
    ours.zero_grad(set_to_none=True)
    logits, loss = ours(ids[:, :-1], targets=ids[:, 1:])
    del logits  # (B, T, vocab): the loss's graph keeps what its backward needs; these are not needed (0.4 GB at 124M)
    loss.backward()
    grads = {name: p.grad.detach() for name, p in ours.named_parameters()}  # the tied head: once
    value = float(loss.detach())
    del ours, loss
    gc.collect()
    return config, value, grads


def _against_float64(load_ours: Callable, ref_path: Path, ids: torch.Tensor, say) -> dict:
    from gpt2port.verification.grads64 import reference_gradients
    from gpt2port.verification.reference import Float64GPT2

    say("gradients: ours")
    config, mine_loss, grads = _ours(load_ours, ids)
    params = len(grads)
    with Float64GPT2(ref_path) as ref:
        loss_ref, max_rel, worst = reference_gradients(ref, ids, config, grads, say)  # empties grads
    return {"reference": "float64", "loss_ours": mine_loss, "loss_ref": loss_ref,
            "loss_rel": abs(mine_loss - loss_ref) / abs(loss_ref), "max_rel": max_rel, "worst": worst,
            "params": params, "tolerance": TOLERANCE}
