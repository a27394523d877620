"""The float64 reference's loss and gradients, for `verify --grads --no-hf`: no transformers anywhere in the run.

The reference's own forward (reference.py: GPT-2 over the raw HF tensors, in float64) differentiated by autograd a
piece at a time, as its logits are computed a slice at a time, so that what is held at once is one piece's work:
  - a forward without gradients keeps each block's input (B x T x C), nothing else;
  - the head and loss, ROWS positions at a time: the final LayerNorm's output is cut from its graph, autograd gives
    each slice's loss gradient with respect to its logits, and the head's product (logits = x @ headᵀ) has its two
    gradients written out (d @ head, dᵀ @ x), the head's accumulated in place: autograd would make a vocab x C
    float64 temporary for every slice, and the head is read in the file's dtype and widened a slice at a time;
  - then from the last block to the first: the block's weights are read and its forward re-run from its kept input
    with gradients, in two halves cut at the residual between attention and MLP (the chain rule across the cut is
    each half's own backward): the MLP half ROWS positions at a time (it treats each position alone), the attention
    half one sequence at a time (it mixes the positions of one sequence only); the weights' gradients accumulate
    over the pieces.
Each gradient is compared with ours as it is made, then it and ours' are dropped (measured: docs/verify.md).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from gpt2port.layouts import HF
from gpt2port.verification.reference import Float64GPT2, layer_norm, logits64

BLOCK_KEYS = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
              "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
              "mlp.c_proj.weight", "mlp.c_proj.bias")
ROWS = 256  # positions whose logits (or MLP activations) exist at once: 256 x 50257 float64 is 0.1 GB
VOCAB_ROWS = 8192  # rows of the head widened to float64 at once (as reference.logits64)


def reference_gradients(ref: Float64GPT2, ids: torch.Tensor, config, grads: dict[str, torch.Tensor],
                        say: Callable[[str], None]) -> tuple[float, float, str]:
    """(the reference's loss, the largest max|Δ|/max|g| of ours' `grads` against its gradients, that parameter's
    name) on the batch `ids` (B, T): predicting ids[:, 1:] from ids[:, :-1], as ours' loss does. Ours' gradients
    are taken out of `grads` as they are compared."""
    cfg = ref.config
    x, targets = ids[:, :-1], ids[:, 1:]
    names = {w.key.removeprefix(HF.write_prefix): (w.source, w.transform) for w in HF.plan_write(config)}
    worst = ["", 0.0]

    def compare(key: str, g: torch.Tensor) -> None:
        source, transform = names[key]
        theirs, mine = g, transform.to_layout(grads.pop(source)).to(torch.float64)
        rel = float((mine - theirs).abs().max()) / (float(theirs.abs().max()) or 1.0)
        if rel >= worst[1]:
            worst[:] = [source, rel]

    wte = ref.files.get("wte.weight")  # the file's dtype: widened to float64 where used, rows or slices at a time
    kept = [wte[x].to(torch.float64) + ref.files.get64("wpe.weight")[: x.shape[1]]]  # each block's input
    with torch.no_grad():
        for i in range(cfg.n_layer):
            say(f"gradients: float64 reference forward, block {i + 1}/{cfg.n_layer}")
            kept.append(_block(ref, kept[-1], _weights(ref, i), i))
    vocab = wte.shape
    head = wte if cfg.tied else ref.files.get("lm_head.weight")
    del wte
    loss, upstream, head_grad = _head_and_loss(ref, kept.pop(), targets, head, compare, say)
    del head
    if not cfg.tied:
        compare("lm_head.weight", head_grad)
        head_grad = None
    for i in reversed(range(cfg.n_layer)):
        say(f"gradients: float64 reference backward, block {i + 1}/{cfg.n_layer}")
        w = {k: t.requires_grad_() for k, t in _weights(ref, i).items()}
        upstream = block_backward(ref, kept.pop(), w, i, upstream)
        for k, t in w.items():
            compare(f"h.{i}.{k}", t.grad)
        del w
    wte_grad = head_grad if cfg.tied else torch.zeros(vocab, dtype=torch.float64)
    wte_grad.index_add_(0, x.reshape(-1), upstream.reshape(-1, upstream.shape[-1]))  # the lookup's share
    compare("wte.weight", wte_grad)
    compare("wpe.weight", F.pad(upstream.sum(0), (0, 0, 0, cfg.n_positions - x.shape[1])))
    return loss, worst[1], worst[0]


def _head_and_loss(ref: Float64GPT2, last: torch.Tensor, targets: torch.Tensor, head: torch.Tensor, compare,
                   say) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(the loss, its gradient with respect to the last block's output, with respect to the head (vocab, C)); the
    final LayerNorm's gradients are compared here."""
    cfg = ref.config
    last = last.requires_grad_()
    ln = [ref.files.get64(k).requires_grad_() for k in ("ln_f.weight", "ln_f.bias")]
    final = layer_norm(last, ln[0], ln[1], cfg.eps)
    flat, rows_of = final.detach().reshape(-1, final.shape[-1]), targets.reshape(-1)
    n = flat.shape[0]
    flat_grad = torch.zeros_like(flat)
    head_grad = torch.zeros(head.shape, dtype=torch.float64)
    loss = 0.0
    for s in range(0, n, ROWS):
        say(f"gradients: float64 reference head and loss, positions {s + 1}-{min(s + ROWS, n)}/{n}")
        rows = flat[s:s + ROWS]
        logits = logits64(rows, head, VOCAB_ROWS).requires_grad_()
        part = F.cross_entropy(logits, rows_of[s:s + ROWS], reduction="sum") / n
        part.backward()
        loss += float(part.detach())
        d = logits.grad
        del logits, part
        head_grad.addmm_(d.T, rows)  # d(loss)/d(head) = dᵀ @ x, summed over the slices in place
        for v in range(0, head.shape[0], VOCAB_ROWS):  # d(loss)/d(x) = d @ head
            flat_grad[s:s + ROWS].addmm_(d[:, v:v + VOCAB_ROWS], head[v:v + VOCAB_ROWS].to(torch.float64))
        del d
    final.backward(flat_grad.view_as(final))
    compare("ln_f.weight", ln[0].grad)
    compare("ln_f.bias", ln[1].grad)
    return loss, last.grad, head_grad


def block_backward(ref: Float64GPT2, h: torch.Tensor, w: dict[str, torch.Tensor], i: int,
                   upstream: torch.Tensor) -> torch.Tensor:
    """The gradient with respect to block i's input h (B, T, C) given `upstream`, the gradient with respect to its
    output; its weights' gradients accumulate in w's leaves. Its forward is re-run from h, a piece at a time."""
    eps = ref.config.eps
    with torch.no_grad():
        mid = h + ref.attention(layer_norm(h, w["ln_1.weight"], w["ln_1.bias"], eps), w, i)
    flat, up = mid.reshape(-1, mid.shape[-1]), upstream.reshape(-1, upstream.shape[-1])
    mid_grad = torch.empty_like(flat)
    for s in range(0, flat.shape[0], ROWS):  # the MLP half: each position alone
        m = flat[s:s + ROWS].detach().requires_grad_()
        (m + ref.mlp(layer_norm(m, w["ln_2.weight"], w["ln_2.bias"], eps), w)).backward(up[s:s + ROWS])
        mid_grad[s:s + ROWS] = m.grad
    del mid, flat, up
    mid_grad = mid_grad.view_as(h)
    h_grad = torch.empty_like(h)
    for b in range(h.shape[0]):  # the attention half: one sequence at a time
        x = h[b:b + 1].detach().requires_grad_()
        (x + ref.attention(layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps), w, i)).backward(mid_grad[b:b + 1])
        h_grad[b:b + 1] = x.grad
    return h_grad


def _weights(ref: Float64GPT2, i: int) -> dict[str, torch.Tensor]:
    return {k: ref.files.get64(f"h.{i}.{k}") for k in BLOCK_KEYS}


def _block(ref: Float64GPT2, h: torch.Tensor, w: dict[str, torch.Tensor], i: int) -> torch.Tensor:
    """The reference's block, as its forward computes it."""
    eps = ref.config.eps
    mid = h + ref.attention(layer_norm(h, w["ln_1.weight"], w["ln_1.bias"], eps), w, i)
    return mid + ref.mlp(layer_norm(mid, w["ln_2.weight"], w["ln_2.bias"], eps), w)
