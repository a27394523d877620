"""gpt_mini style: learned positions, a fused qkv and its proj without biases (so GPT-2's attention biases cannot be
held), an fc/proj MLP with biases, and a `head` that shares its weight with `tok_emb`. Blocks are called through
a plain loop over a ModuleList; the attention goes through PyTorch's fused kernel rather than a mask buffer."""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from tests.userclasses import _parts


class Attention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(
            _parts.split_heads(q, self.h), _parts.split_heads(k, self.h), _parts.split_heads(v, self.h),
            is_causal=True)
        return self.proj(_parts.merge_heads(out))


class FeedForward(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(d), Attention(d, h)
        self.norm2, self.mlp = nn.LayerNorm(d), FeedForward(d)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPTMini(nn.Module):
    def __init__(self, vocab, ctx, layers, h, d):
        super().__init__()
        self.ctx = ctx
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # share storage

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb.weight[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def build(vocab_size, block_size, n_layer, n_head, n_embd):
    return GPTMini(vocab_size, block_size, n_layer, n_head, n_embd)


def logits(model, idx):
    return model(idx)


def hand_load(model, canonical):
    _parts.put_ends(canonical, model.tok_emb.weight, model.pos_emb.weight, model.ln_f)
    for i, b in enumerate(model.blocks):
        _parts.put_block(canonical, i, ln1=b.norm1, ln2=b.norm2, qkv=b.attn.qkv, proj=b.attn.proj, fc=b.mlp.fc,
                         mlp_proj=b.mlp.proj)
