"""The float64 reference's loss and gradients, for `verify --grads --no-hf`: no transformers anywhere in the run.

The reference's own forward (reference.py: GPT-2 over the raw HF tensors, in float64) differentiated by autograd,
a block at a time, as its logits are computed a slice at a time: a forward without gradients keeps each block's
input (B x T x C); the loss's gradient comes from the head a slice of rows at a time; then from the last block to
the first, one block's weights are read, its forward re-run from its kept input with gradients, and its backward
taken. Each gradient is compared with ours as it is made and dropped: what is held is ours' gradients, the
embedding's float64 copy and its gradient, the kept inputs and one block's work (measured: docs/verify.md).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from gpt2port.layouts import HF
from gpt2port.verification.reference import Float64GPT2, layer_norm

BLOCK_KEYS = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
              "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
              "mlp.c_proj.weight", "mlp.c_proj.bias")
ROWS = 256  # positions whose logits exist at once: 256 x 50257 float64 is 0.1 GB


def reference_gradients(ref: Float64GPT2, ids: torch.Tensor, config, grads: dict[str, torch.Tensor],
                        say: Callable[[str], None]) -> tuple[float, float, str]:
    """(the reference's loss, the largest max|Δ|/max|g| of ours' `grads` against its gradients, that parameter's
    name) on the batch `ids` (B, T): predicting ids[:, 1:] from ids[:, :-1], as ours' loss does."""
    cfg = ref.config
    x, targets = ids[:, :-1], ids[:, 1:]
    names = {w.key.removeprefix(HF.write_prefix): (w.source, w.transform) for w in HF.plan_write(config)}
    worst = ["", 0.0]

    def compare(key: str, g: torch.Tensor) -> None:
        source, transform = names[key]
        theirs, mine = g, transform.to_layout(grads[source]).to(torch.float64)
        rel = float((mine - theirs).abs().max()) / (float(theirs.abs().max()) or 1.0)
        if rel >= worst[1]:
            worst[:] = [source, rel]

    wte = ref.files.get64("wte.weight")
    wpe = ref.files.get64("wpe.weight")[: x.shape[1]]
    kept = [wte[x] + wpe]  # each block's input, kept: its forward is re-run with gradients in the backward
    with torch.no_grad():
        for i in range(cfg.n_layer):
            say(f"gradients: float64 reference forward, block {i + 1}/{cfg.n_layer}")
            kept.append(_block(ref, kept[-1], _weights(ref, i), i))
    say("gradients: float64 reference head and loss")
    last = kept.pop().requires_grad_()
    ln = [ref.files.get64(k).requires_grad_() for k in ("ln_f.weight", "ln_f.bias")]
    final = layer_norm(last, ln[0], ln[1], cfg.eps)
    head = wte.requires_grad_() if cfg.tied else ref.files.get64("lm_head.weight").requires_grad_()
    flat, rows_of = final.detach().reshape(-1, final.shape[-1]).requires_grad_(), targets.reshape(-1)
    loss = 0.0
    for s in range(0, flat.shape[0], ROWS):
        part = F.cross_entropy(flat[s:s + ROWS] @ head.T, rows_of[s:s + ROWS], reduction="sum") / flat.shape[0]
        part.backward()
        loss += float(part.detach())
    final.backward(flat.grad.view_as(final))
    del flat, final
    compare("ln_f.weight", ln[0].grad)
    compare("ln_f.bias", ln[1].grad)
    if not cfg.tied:
        compare("lm_head.weight", head.grad)
        head.grad = None
    upstream = last.grad
    for i in reversed(range(cfg.n_layer)):
        say(f"gradients: float64 reference backward, block {i + 1}/{cfg.n_layer}")
        w = {k: t.requires_grad_() for k, t in _weights(ref, i).items()}
        inp = kept.pop().requires_grad_()
        _block(ref, inp, w, i).backward(upstream)
        for k, t in w.items():
            compare(f"h.{i}.{k}", t.grad)
        upstream = inp.grad
        del w, inp
    wte_grad = wte.grad if cfg.tied else torch.zeros_like(wte)
    wte_grad.index_add_(0, x.reshape(-1), upstream.reshape(-1, upstream.shape[-1]))  # the lookup's share
    compare("wte.weight", wte_grad)
    compare("wpe.weight", torch.nn.functional.pad(upstream.sum(0), (0, 0, 0, cfg.n_positions - x.shape[1])))
    return loss, worst[1], worst[0]


def _weights(ref: Float64GPT2, i: int) -> dict[str, torch.Tensor]:
    return {k: ref.files.get64(f"h.{i}.{k}") for k in BLOCK_KEYS}


def _block(ref: Float64GPT2, h: torch.Tensor, w: dict[str, torch.Tensor], i: int) -> torch.Tensor:
    """The reference's block, as its forward computes it."""
    eps = ref.config.eps
    mid = h + ref.attention(layer_norm(h, w["ln_1.weight"], w["ln_1.bias"], eps), w, i)
    return mid + ref.mlp(layer_norm(mid, w["ln_2.weight"], w["ln_2.bias"], eps), w)
