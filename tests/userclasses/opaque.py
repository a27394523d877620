"""The Opaque Box style: attention as a MultiHeadAttention of separate SelfAttentionHead modules, each with its own
query/key/value Linears of (C/H, C); blocks as a Sequential; ln_f; an untied lm_head that keeps nn.Linear's default
bias, which GPT-2's head does not have (a hand loader sets it to zero)."""

from __future__ import annotations

import torch
import torch.nn as nn

from tests.userclasses import _parts


class SelfAttentionHead(nn.Module):
    def __init__(self, d_model, head_size, context_length):
        super().__init__()
        self.query = nn.Linear(d_model, head_size)
        self.key = nn.Linear(d_model, head_size)
        self.value = nn.Linear(d_model, head_size)
        self.register_buffer("tril", torch.tril(torch.ones(context_length, context_length)))

    def forward(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)  # each (B, T, head_size)
        return _parts.attend(q, k, v, self.tril)


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, num_heads, context_length):
        super().__init__()
        self.heads = nn.ModuleList(
            SelfAttentionHead(d_model, d_model // num_heads, context_length) for _ in range(num_heads))
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))


class FeedForward(nn.Module):
    def __init__(self, d_model, dropout):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * d_model, d_model), nn.Dropout(dropout))

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    def __init__(self, d_model, num_heads, context_length, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, num_heads, context_length)
        self.ln2 = nn.LayerNorm(d_model)
        self.ffwd = FeedForward(d_model, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ffwd(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, context_length, d_model, num_heads, num_layers, dropout=0.0):
        super().__init__()
        self.context_length = context_length
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(context_length, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[Block(d_model, num_heads, context_length, dropout) for _ in range(num_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.drop(self.token_embedding(idx) + self.position_embedding(torch.arange(T, device=idx.device)))
        return self.lm_head(self.ln_f(self.blocks(x)))


def build(vocab_size, block_size, n_layer, n_head, n_embd):
    return GPT(vocab_size, block_size, n_embd, n_head, n_layer)


def logits(model, idx):
    return model(idx)


def hand_load(model, canonical):
    tok = _parts.put_ends(canonical, model.token_embedding.weight, model.position_embedding.weight, model.ln_f)
    for i, blk in enumerate(model.blocks):
        t = _parts.put_block(canonical, i, ln1=blk.ln1, ln2=blk.ln2, proj=blk.attn.proj, fc=blk.ffwd.net[0],
                             mlp_proj=blk.ffwd.net[2])
        _parts.put_heads(blk.attn.heads, t)
    _parts.put_linear(model.lm_head, tok, torch.zeros(model.lm_head.out_features))  # GPT-2's head has no bias
