"""What the optimizer does at each step: AdamW with weight decay on matrices only, warmup then cosine decay.

Decay on 2-D weights only (linear layers and embeddings; the tied head is the embedding, counted once) and none on
biases and LayerNorm gains: decaying those pulls them towards zero, which nothing in GPT-2 wants.
"""

from __future__ import annotations

import math

import torch


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a shared (tied) Parameter once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95), eps: float = 1e-8):
    """AdamW over `model` (betas as GPT-style training uses them). foreach: one kernel per group, on every device."""
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, foreach=True)


def lr_at(step: int, *, lr: float, warmup: int, steps: int, min_lr: float) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warmup over `warmup` steps up to `lr`, then
    a half cosine down to `min_lr` at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
