"""Weights at the scales a trained GPT-2 runs at, for tests that judge numerics.

Random weights at the 0.02 init keep every pre-activation near zero: attention is nearly uniform, tanh and erf GELU
agree to 1e-7, ReLU and GELU barely differ, and a test that should fail passes. These weights give q/k and MLP
pre-activations of std ~2, LayerNorm gains 1 +- 0.3 with non-zero shifts, non-zero biases everywhere and a few
outlier residual channels, as trained GPT-2 has. They work on any module whose parameters carry GPT-2's roles
under HF's names (GPT2LMHeadModel) or gpt2port's (GPT).

    model = realistic_hf_model("gpt2", seed=0)          # or a dict such as TINY
    make_realistic_(model, seed=0)                      # in place, on an HF or gpt2port model
    stats = activation_stats(model, idx)                # measured std of q/k and MLP pre-activations
"""

from __future__ import annotations

import math

import torch

# name fragment -> role, for HF's GPT2LMHeadModel and gpt2port's GPT alike
_ROLES = (
    (("wte.weight", "tok_emb.weight"), "wte"),
    (("wpe.weight", "pos_emb.weight"), "wpe"),
    ((".c_attn.weight", ".attn.qkv.weight"), "qkv_w"),
    ((".c_attn.bias", ".attn.qkv.bias"), "qkv_b"),
    ((".attn.c_proj.weight", ".attn.proj.weight"), "attn_proj_w"),
    ((".attn.c_proj.bias", ".attn.proj.bias"), "proj_b"),
    ((".c_fc.weight", ".mlp.fc.weight"), "fc_w"),
    ((".c_fc.bias", ".mlp.fc.bias"), "fc_b"),
    ((".mlp.c_proj.weight", ".mlp.proj.weight"), "mlp_proj_w"),
    ((".mlp.c_proj.bias", ".mlp.proj.bias"), "proj_b"),
)
OUTLIERS = 2  # residual channels that carry large offsets, as a few channels of trained GPT-2 do


def _role(name: str) -> str | None:
    if "lm_head" in name:
        return None  # tied to wte, or set from it below
    for fragments, role in _ROLES:
        if any(name.endswith(f) or f in name for f in fragments):
            return role
    if ("ln" in name or "norm" in name) and name.endswith("weight"):
        return "ln_gain"
    if ("ln" in name or "norm" in name) and name.endswith("bias"):
        return "ln_shift"
    return None


@torch.no_grad()
def make_realistic_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Overwrite `model`'s parameters in place with realistic-scale values (deterministic for a seed)."""
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    C = next(p for n, p in params.items() if _role(n) == "wte").shape[1]

    def normal(p, std, mean=0.0):
        p.copy_((torch.randn(p.shape, generator=g) * std + mean).to(p.dtype))

    outliers = torch.randperm(C, generator=g)[:OUTLIERS]
    for name, p in params.items():
        role = _role(name)
        if role == "wte":
            normal(p, 3.0 / math.sqrt(C))  # final-LN output (unit variance) @ wte^T: logits of std ~3
            p[:, outliers] += 8.0 / math.sqrt(C) * (1 + torch.rand(p.shape[0], OUTLIERS, generator=g))
        elif role == "wpe":
            normal(p, 1.0 / math.sqrt(C))
        elif role == "ln_gain":
            p.copy_((1.0 + 0.3 * torch.randn(p.shape, generator=g)).clamp(0.3, 1.9))
            if p.numel() == C:
                p[outliers] = 0.2  # trained GPT-2 damps its outlier channels in the norms
        elif role == "ln_shift":
            normal(p, 0.1)
        elif role == "qkv_w":
            normal(p, 2.5 / math.sqrt(C))  # q, k, v of std ~2 on a unit-variance input: peaked attention
        elif role == "qkv_b":
            normal(p, 0.3)
        elif role == "attn_proj_w":
            normal(p, 0.5 / math.sqrt(C))
        elif role == "fc_w":
            normal(p, 2.5 / math.sqrt(C))  # MLP pre-activations of std ~2: tanh/erf GELU and ReLU part ways
        elif role == "fc_b":
            normal(p, 0.5)
        elif role == "mlp_proj_w":
            normal(p, 0.5 / math.sqrt(4 * C))
        elif role == "proj_b":
            normal(p, 0.05)
            if p.numel() == C:
                p[outliers] += 0.5
    return model


def realistic_hf_model(size: str | dict, seed: int = 0, **overrides):
    """A transformers GPT2LMHeadModel (a preset name or a shape dict) with realistic-scale weights."""
    from scripts import hf_fixtures

    model = hf_fixtures.make_hf_model(hf_fixtures.hf_config(size, **overrides), seed=seed)
    return make_realistic_(model, seed)


@torch.no_grad()
def activation_stats(model: torch.nn.Module, idx: torch.Tensor) -> dict[str, float]:
    """Std of the q|k|v and MLP pre-activations over every layer, measured by hooks on one forward."""
    seen: dict[str, list[torch.Tensor]] = {"qkv": [], "fc": []}
    hooks = []
    for name, m in model.named_modules():
        if name.endswith(("c_attn", "attn.qkv")):
            hooks.append(m.register_forward_hook(lambda _m, _i, out: seen["qkv"].append(out.float().flatten())))
        elif name.endswith(("c_fc", "mlp.fc")):
            hooks.append(m.register_forward_hook(lambda _m, _i, out: seen["fc"].append(out.float().flatten())))
    try:
        model(idx)
    finally:
        for h in hooks:
            h.remove()
    return {k: torch.cat(v).std().item() for k, v in seen.items() if v}


def realistic_checkpoint(out, size: str | dict, seed: int = 0, **overrides):
    """An HF repo (hub layout, out/hf) and its gpt2port conversion (out/ckpt) of realistic-scale weights."""
    from pathlib import Path

    from gpt2port import convert
    from scripts import hf_fixtures

    out = Path(out)
    hf_fixtures.write_repo(realistic_hf_model(size, seed, **overrides), out / "hf", "hub", "fp32")
    convert(out / "hf", out / "ckpt")
    return out / "hf", out / "ckpt"
