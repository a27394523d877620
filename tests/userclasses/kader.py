"""Day 7 style: tok_emb/pos_emb, a ModuleList of pre-LN blocks, ln_f, and an lm_head tied to tok_emb. Attention's
fused qkv and proj and the MLP's fc and proj are built without biases, so GPT-2's biases have nowhere to go;
bias=True is the variant a learner writes to hold them. The GELU is the tanh form GPT-2 was trained with."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.userclasses import _parts


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size, bias):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.register_buffer("mask", _parts.causal_mask(block_size))

    def forward(self, x):
        C = x.shape[-1]
        q, k, v = (_parts.split_heads(t, self.n_head) for t in self.qkv(x).split(C, dim=2))
        return self.proj(_parts.merge_heads(_parts.attend(q, k, v, self.mask)))


class MLP(nn.Module):
    def __init__(self, n_embd, bias):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size, bias):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, bias)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, bias)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, bias=False):
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, block_size, bias) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # one Parameter, two modules

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def build(vocab_size, block_size, n_layer, n_head, n_embd, bias=False):
    return GPT(vocab_size, block_size, n_layer, n_head, n_embd, bias=bias)


def logits(model, idx):
    return model(idx)[0]


def hand_load(model, canonical):
    _parts.put_ends(canonical, model.tok_emb.weight, model.pos_emb.weight, model.ln_f)  # the tied head follows
    for i, blk in enumerate(model.blocks):
        _parts.put_block(canonical, i, ln1=blk.ln1, ln2=blk.ln2, qkv=blk.attn.qkv, proj=blk.attn.proj,
                         fc=blk.mlp.fc, mlp_proj=blk.mlp.proj)
