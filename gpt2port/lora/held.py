"""The frozen base of a LoRA run held in bf16 (`finetune --lora-base-dtype bf16`): half the memory of its matrices,
the arithmetic still fp32.

Each frozen matrix (every block's four, and the token embedding the head is tied to) is stored in bf16; a product
with it upcasts the matrix for that product alone (HeldLinear), and the backward upcasts it again rather than
keeping the fp32 copy, which would bring the memory back. What is computed is then exactly the fp32 model whose
base weights are rounded to bf16 (tested), and gradients reach the adapters through it. Biases, LayerNorms and the
position embedding (small) stay fp32, so the residual stream stays fp32. At the end of a run the checkpoint's fp32
weights are put back (restore_) before the adapters are merged: the merged model is the fp32 base plus the adapter.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2port.lora.layer import _parent

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class _HeldProduct(torch.autograd.Function):
    """x W^T + b with W held in a lower precision: W is saved as held, and upcast in the forward and again in the
    backward. W and b are frozen: the gradient is the input's alone."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(w)
        return F.linear(x, w.to(x.dtype), b)

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return grad @ w.to(grad.dtype) if ctx.needs_input_grad[0] else None, None, None


class HeldLinear(nn.Linear):
    """An nn.Linear (the same names: weight, bias) whose frozen weight is held in another dtype than its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _HeldProduct.apply(x, self.weight, self.bias)


def _held(linear: nn.Linear, weight: nn.Parameter) -> HeldLinear:
    out, inp = linear.weight.shape
    with torch.device("meta"):
        m = HeldLinear(inp, out, bias=linear.bias is not None)
    m.weight, m.bias = weight, linear.bias
    return m


def _frozen_matrices(model: nn.Module):
    """(parent, attribute, nn.Linear) of every frozen matrix in the blocks and the head."""
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Linear) and not isinstance(m, HeldLinear) and not m.weight.requires_grad:
            yield (*_parent(model, name), m) if "." in name else (model, name, m)


@torch.no_grad()
def hold_(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Hold every frozen matrix of gpt2port's GPT `model` (adapters attached) in `dtype`, in place; the tied head
    stays one Parameter with the token embedding. Returns the bytes saved."""
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = model.lm_head.weight is model.tok_emb.weight
    emb = nn.Parameter(model.tok_emb.weight.to(dtype), requires_grad=False)
    model.tok_emb.weight = emb  # an embedding's lookup is exact in any dtype; the sum with positions is fp32
    for parent, attr, m in _frozen_matrices(model):
        w = emb if (tied and m is model.lm_head) else nn.Parameter(m.weight.to(dtype), requires_grad=False)
        setattr(parent, attr, _held(m, w))
    return before - sum(p.numel() * p.element_size() for p in model.parameters())


@torch.no_grad()
def restore_(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Put the fp32 weights back in a model `hold_` changed: plain nn.Linear modules holding `weights[name]` (the
    checkpoint's tensors, gpt2port's names: views of its copy-on-write map, so merging into them copies only the
    pages it changes), the LoRA modules keeping their adapters."""
    tied = model.lm_head.weight is model.tok_emb.weight
    model.tok_emb.weight = nn.Parameter(weights["tok_emb.weight"].float(), requires_grad=False)
    for name, m in list(model.named_modules()):
        if not isinstance(m, HeldLinear):
            continue
        key = name[: -len(".base")] if name.endswith(".base") else name  # a LoRA module's base: the matrix's name
        w = model.tok_emb.weight if (tied and m is model.lm_head) else \
            nn.Parameter(weights[f"{key}.weight"].float(), requires_grad=False)
        with torch.device("meta"):
            plain = nn.Linear(w.shape[1], w.shape[0], bias=m.bias is not None)
        plain.weight, plain.bias = w, m.bias
        parent, attr = _parent(model, name) if "." in name else (model, name)
        setattr(parent, attr, plain)


def is_held(model: nn.Module) -> bool:
    return any(isinstance(m, HeldLinear) for m in model.modules())

