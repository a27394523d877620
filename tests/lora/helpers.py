"""LoRA test helpers: gpt2port models with trained-like adapters, inputs, the relative difference."""

from __future__ import annotations

import torch

from scripts.hf_fixtures import TINY

ALL = ("qkv", "attn_proj", "fc", "mlp_proj")


def lora_model(ckpt, targets=ALL, rank=4, alpha=8.0, split_qkv=False, seed=0):
    """gpt2port's GPT from `ckpt` in fp32 with adapters whose B is not zero (as after training): A at its init,
    B of the size that moves the logits by a few percent."""
    from gpt2port import GPT
    from gpt2port.lora import layer
    from gpt2port.lora.spec import Spec

    model = GPT.from_pretrained(ckpt, dtype=torch.float32)
    swapped = layer.attach(model, Spec(rank, alpha, tuple(targets), split_qkv), torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in swapped.values():
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.5 / m.lora_B.shape[-1] ** 0.5)
    return model.eval()


def ids(n_batch=2, T=24, seed=3) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (n_batch, T), generator=torch.Generator().manual_seed(seed))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b|."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
