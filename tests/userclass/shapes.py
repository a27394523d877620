"""Classes written fresh in the shapes the third round found without a verdict or with a wrong one: heads merged
with a permute that mixes a batch's sequences, nn.MultiheadAttention, attention and the MLP written inline in the
block (raw Parameters, einsum, softmax), a final norm defined but never called, residuals scaled by 1/sqrt(2).

build(config, kind, **options) -> the class at a GPT-2 config's shape; each `kind` is a block written as people
write it, inside one nanoGPT-style shell."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def gelu_tanh(x, c=0.044715):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + c * torch.pow(x, 3.0))))


ACTS = {"tanh": gelu_tanh, "typo": lambda x: gelu_tanh(x, 0.44715), "relu": F.relu,
        "erf": F.gelu}


class SelfAttention(nn.Module):
    """nanoGPT's, with the head merge as written by the user (`merge`)."""

    def __init__(self, C, H, P, merge="transpose"):
        super().__init__()
        self.n_head, self.merge = H, merge
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.register_buffer("bias", torch.tril(torch.ones(P, P)).view(1, 1, P, P))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")), dim=-1)
        y = att @ v  # (B, H, T, D)
        if self.merge == "permute":  # (T, B, H, D): right for one sequence, mixes sequences in a batch
            y = y.permute(2, 0, 1, 3).reshape(B, T, C)
        else:
            y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class ModuleBlock(nn.Module):
    def __init__(self, C, H, P, merge="transpose", residual=1.0):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn = SelfAttention(C, H, P, merge)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(approximate="tanh"), nn.Linear(4 * C, C))
        self.residual = residual

    def forward(self, x):
        x = x + self.residual * self.attn(self.ln_1(x))
        return x + self.residual * self.mlp(self.ln_2(x))


class MHABlock(nn.Module):
    """Attention as torch's nn.MultiheadAttention, masked with a boolean triu (True: may not attend)."""

    def __init__(self, C, H, P, diagonal=1):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn = nn.MultiheadAttention(C, H, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(approximate="tanh"), nn.Linear(4 * C, C))
        self.register_buffer("mask", torch.triu(torch.ones(P, P, dtype=torch.bool), diagonal=diagonal))

    def forward(self, x):
        T = x.shape[1]
        h = self.ln_1(x)
        a, _ = self.attn(h, h, h, attn_mask=self.mask[:T, :T], need_weights=False)
        x = x + a
        return x + self.mlp(self.ln_2(x))


class InlineBlock(nn.Module):
    """Everything in the block's own forward: raw Parameters, einsum, softmax, the GELU typed out."""

    def __init__(self, C, H, P, scale=True, act="tanh", alpha=False):
        super().__init__()
        self.n_head, self.scale, self.act, self.alpha = H, scale, ACTS[act], alpha
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.w_qkv, self.b_qkv = nn.Parameter(torch.randn(C, 3 * C) * 0.02), nn.Parameter(torch.zeros(3 * C))
        self.w_o, self.b_o = nn.Parameter(torch.randn(C, C) * 0.02), nn.Parameter(torch.zeros(C))
        self.w_fc, self.b_fc = nn.Parameter(torch.randn(C, 4 * C) * 0.02), nn.Parameter(torch.zeros(4 * C))
        self.w_out, self.b_out = nn.Parameter(torch.randn(4 * C, C) * 0.02), nn.Parameter(torch.zeros(C))

    def forward(self, x):
        B, T, C = x.shape
        H = self.n_head
        q, k, v = (self.ln_1(x) @ self.w_qkv + self.b_qkv).split(C, dim=-1)
        q, k, v = (t.reshape(B, T, H, C // H) for t in (q, k, v))
        s = torch.einsum("bthd,bshd->bhts", q, k)
        if self.scale:
            s = s / math.sqrt(C // H)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = torch.einsum("bhts,bshd->bthd", s.softmax(dim=-1), v).reshape(B, T, C)
        if self.alpha:  # torch.add(..., alpha=1): additions the residual watch does not follow
            x = torch.add(x, y @ self.w_o + self.b_o, alpha=1.0)
            return torch.add(x, self.act(self.ln_2(x) @ self.w_fc + self.b_fc) @ self.w_out + self.b_out, alpha=1.0)
        x = x + y @ self.w_o + self.b_o
        return x + self.act(self.ln_2(x) @ self.w_fc + self.b_fc) @ self.w_out + self.b_out


class InlineMLPBlock(nn.Module):
    """nanochat's way of writing the block with GPT-2's parts: Linears in the block, the MLP inline."""

    def __init__(self, C, H, P, act="relu"):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn = SelfAttention(C, H, P)
        self.c_fc, self.c_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        self.act = ACTS[act]

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(self.act(self.c_fc(self.ln_2(x))))


BLOCKS = {"module": ModuleBlock, "mha": MHABlock, "inline": InlineBlock, "inline_mlp": InlineMLPBlock}


class GPT(nn.Module):
    def __init__(self, V, P, L, H, C, kind="module", final_norm=True, **options):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(P, C)
        self.h = nn.ModuleList(BLOCKS[kind](C, H, P, **options) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        self.lm_head = nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.wte.weight
        self.final_norm = final_norm

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        if self.final_norm:
            x = self.ln_f(x)
        return self.lm_head(x)


def build(config, kind="module", **options):
    return GPT(config.vocab_size, config.n_positions, config.n_layer, config.n_head, config.n_embd, kind, **options)
