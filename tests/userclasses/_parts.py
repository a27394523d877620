"""Pieces every hand-written GPT class re-derives: causal attention written out, the tanh GELU written out, and the
small copying steps of a hand-written GPT-2 loader. Kept once here so that each style module shows only what makes
its class different (names, containers, fused or split projections, tied or untied head)."""

from __future__ import annotations

import math

import torch

from gpt2port.layouts import canonical as canon


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU, the tanh approximation, written out as tutorials write it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def causal_mask(block_size: int) -> torch.Tensor:
    """(1, 1, T, T) lower-triangular ones: the buffer most tutorials register."""
    return torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)


def split_heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """(B, T, C) -> (B, H, T, C/H)."""
    B, T, C = x.shape
    return x.view(B, T, n_head, C // n_head).transpose(1, 2)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (B, T, H*D)."""
    B, H, T, D = y.shape
    return y.transpose(1, 2).contiguous().view(B, T, H * D)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention the long way: scores, -inf above the diagonal, softmax, weighted values.
    `mask` is a (.., T_max, T_max) tensor of ones and zeros; works for (B, H, T, D) and per-head (B, T, D)."""
    T = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])
    scores = scores.masked_fill(mask[..., :T, :T] == 0, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


# --- what a hand-written loader does with GPT-2's tensors --------------------------------------------------------

def put(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy `value` into an existing parameter, refusing a shape mismatch as a learner's loader would."""
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs GPT-2 tensor {tuple(value.shape)}")
    with torch.no_grad():
        param.copy_(value)


def put_linear(linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Fill an nn.Linear; a Linear built without a bias simply does not get GPT-2's (the loss a biasless class
    accepts)."""
    put(linear.weight, weight)
    if linear.bias is not None and bias is not None:
        put(linear.bias, bias)


def put_norm(norm, canonical: dict, prefix: str) -> None:
    """A LayerNorm, PyTorch's (weight, bias) or hand-written (scale, shift), from `prefix`.weight/.bias."""
    weight, bias = (norm.weight, norm.bias) if hasattr(norm, "weight") else (norm.scale, norm.shift)
    put(weight, canonical[f"{prefix}.weight"])
    put(bias, canonical[f"{prefix}.bias"])


def put_ends(canonical: dict, tok_table, pos_table, final_norm) -> torch.Tensor:
    """Token and position tables (positions cropped to the class's rows) and the final norm; returns the token
    table for an untied head to copy."""
    tok = canonical[canon.EMBEDDING]
    put(tok_table, tok)
    put(pos_table, canonical[canon.POSITIONS][: pos_table.shape[0]])
    put_norm(final_norm, canonical, "final_norm")
    return tok


def put_block(canonical: dict, i: int, *, ln1, ln2, proj, fc, mlp_proj, qkv=None) -> dict[str, torch.Tensor]:
    """Layer i's norms, attention output and MLP, and the fused qkv Linear if the class has one; returns the
    layer's tensors (see block()) for the class to place split q, k, v itself."""
    t = block(canonical, i)
    put_norm(ln1, canonical, f"blocks.{i}.ln1")
    put_norm(ln2, canonical, f"blocks.{i}.ln2")
    if qkv is not None:
        put_linear(qkv, t["attn.qkv.weight"], t["attn.qkv.bias"])
    put_linear(proj, t["attn.proj.weight"], t["attn.proj.bias"])
    put_linear(fc, t["mlp.fc.weight"], t["mlp.fc.bias"])
    put_linear(mlp_proj, t["mlp.proj.weight"], t["mlp.proj.bias"])
    return t


def block(canonical: dict, i: int) -> dict[str, torch.Tensor]:
    """Layer i's tensors by short name ("ln1.weight", "attn.qkv.weight", ...), plus q/k/v split out of the fused
    projection: "q.weight", "k.bias", ..."""
    prefix = f"blocks.{i}."
    out = {name[len(prefix):]: t for name, t in canonical.items() if name.startswith(prefix)}
    for kind in ("weight", "bias"):
        q, k, v = out[f"attn.qkv.{kind}"].chunk(3, dim=0)
        out.update({f"q.{kind}": q, f"k.{kind}": k, f"v.{kind}": v})
    return out


# --- modules that the LLMs-from-scratch family writes by hand -----------------------------------------------------

class ScaleShiftLayerNorm(torch.nn.Module):
    """LayerNorm written out, with learned `scale` and `shift` instead of weight and bias."""

    def __init__(self, emb_dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.scale = torch.nn.Parameter(torch.ones(emb_dim))
        self.shift = torch.nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        return self.scale * (x - mean) / torch.sqrt(var + self.eps) + self.shift


class GELU(torch.nn.Module):
    def forward(self, x):
        return gelu_tanh(x)


def put_heads(heads, t: dict) -> None:
    """Per-head attention: head h's query/key/value Linears take rows h*D:(h+1)*D of GPT-2's q, k and v."""
    D = t["q.weight"].shape[0] // len(heads)
    for h, head in enumerate(heads):
        rows = slice(h * D, (h + 1) * D)
        for kind, linear in (("q", head.query), ("k", head.key), ("v", head.value)):
            put_linear(linear, t[f"{kind}.weight"][rows], t[f"{kind}.bias"][rows])
