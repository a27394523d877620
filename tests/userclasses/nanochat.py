"""nanochat style, not GPT-2-shaped: no position table (rotary embeddings on q and k), an RMS norm with no learned
parameters (and q/k normed too), ReLU² in the MLP, no biases anywhere, an untied lm_head, and a 65,536-token
vocabulary by default. A loader must refuse it, listing every reason."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.userclasses import _parts


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def apply_rotary(x, cos, sin):
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_q = nn.Linear(n_embd, n_embd, bias=False)
        self.c_k = nn.Linear(n_embd, n_embd, bias=False)
        self.c_v = nn.Linear(n_embd, n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x, cos, sin):
        T = x.shape[1]
        q, k, v = (_parts.split_heads(f(x), self.n_head) for f in (self.c_q, self.c_k, self.c_v))
        q, k = norm(apply_rotary(q, cos[:T], sin[:T])), norm(apply_rotary(k, cos[:T], sin[:T]))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(_parts.merge_heads(y))


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.mlp = MLP(n_embd)

    def forward(self, x, cos, sin):
        x = x + self.attn(norm(x), cos, sin)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, sequence_len, n_layer, n_head, n_embd):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        half = n_embd // n_head // 2
        inv_freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
        freqs = torch.outer(torch.arange(sequence_len, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, idx, targets=None):
        x = norm(self.transformer.wte(idx))
        for block in self.transformer.h:
            x = block(x, self.cos, self.sin)
        logits = self.lm_head(norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(vocab_size=65536, block_size=64, n_layer=2, n_head=4, n_embd=32):
    return GPT(vocab_size, block_size, n_layer, n_head, n_embd)


def logits(model, idx):
    return model(idx)
