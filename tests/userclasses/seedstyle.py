"""Day 7 style as published: F.gelu (the exact erf form) in the MLP, GPT-2's init scheme (0.02 everywhere, the
residual projections scaled by 1/sqrt(2 n_layer)), biases zeroed at init. Options give the variants a learner
writes next: another activation ("tanh", "relu", "relu2"), and the MLP's output projection initialised to zero
(nanochat and several tutorials do, so that each block starts as the identity), and attention scores left unscaled
(scale=False), a mistake no starting weight shows. At a narrow width these starting
weights keep every pre-activation near zero, so nothing about the activation can be read from them."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.userclasses import _parts
from tests.userclasses.kader import CausalSelfAttention as Attention  # the same attention as Day 7

ACTS = {
    "erf": F.gelu,
    "tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
}


class Unscaled(Attention):
    """The mistake of forgetting 1/sqrt(head_dim) on the scores."""

    def forward(self, x):
        q, k, v = (_parts.split_heads(t, self.n_head) for t in self.qkv(x).split(x.shape[-1], dim=2))
        return self.proj(_parts.merge_heads(_parts.attend(q * math.sqrt(q.shape[-1]), k, v, self.mask)))


class MLP(nn.Module):
    def __init__(self, n_embd, bias, act):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.act = ACTS[act]

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size, bias, act, scale):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(n_embd), (Attention if scale else Unscaled)(n_embd, n_head, block_size, bias)
        self.ln2, self.mlp = nn.LayerNorm(n_embd), MLP(n_embd, bias, act)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, bias=True, act="erf", zero_proj=False,
                 scale=True):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, block_size, bias, act, scale) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        if zero_proj:
            for b in self.blocks:
                nn.init.zeros_(b.mlp.proj.weight)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def build(vocab_size, block_size, n_layer, n_head, n_embd, **options):
    return GPT(vocab_size, block_size, n_layer, n_head, n_embd, **options)


def logits(model, idx):
    return model(idx)
