"""The per-head lecture style: Head modules with key/query/value Linears (bias option; the lecture builds them
without) that compute k before q; MultiHeadAttention of a heads ModuleList plus proj; FeedForward.net as
Sequential(Linear, act, Linear, Dropout) with act ReLU (the lecture's) or the tanh GELU; an lm_head with a bias;
forward(idx, targets=None) -> (logits, loss)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.userclasses import _parts

ACTS = {"relu": nn.ReLU, "gelu_tanh": _parts.GELU}


class Head(nn.Module):
    def __init__(self, n_embd, head_size, block_size, bias):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=bias)
        self.query = nn.Linear(n_embd, head_size, bias=bias)
        self.value = nn.Linear(n_embd, head_size, bias=bias)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        T = x.shape[1]
        k = self.key(x)
        q = self.query(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        wei = self.dropout(F.softmax(wei, dim=-1))
        return wei @ self.value(x)


class MultiHeadAttention(nn.Module):
    def __init__(self, n_embd, num_heads, block_size, bias):
        super().__init__()
        self.heads = nn.ModuleList([Head(n_embd, n_embd // num_heads, block_size, bias) for _ in range(num_heads)])
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        return self.dropout(self.proj(torch.cat([h(x) for h in self.heads], dim=-1)))


class FeedFoward(nn.Module):
    def __init__(self, n_embd, act):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), ACTS[act](), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(0.0))

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size, bias, act):
        super().__init__()
        self.sa = MultiHeadAttention(n_embd, n_head, block_size, bias)
        self.ffwd = FeedFoward(n_embd, act)
        self.ln1 = nn.LayerNorm(n_embd)
        self.ln2 = nn.LayerNorm(n_embd)

    def forward(self, x):
        x = x + self.sa(self.ln1(x))
        return x + self.ffwd(self.ln2(x))


class GPTLanguageModel(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, bias, act):
        super().__init__()
        self.block_size = block_size
        self.token_embedding_table = nn.Embedding(vocab_size, n_embd)
        self.position_embedding_table = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head, block_size, bias, act) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        tok_emb = self.token_embedding_table(idx)
        pos_emb = self.position_embedding_table(torch.arange(T, device=idx.device))
        logits = self.lm_head(self.ln_f(self.blocks(tok_emb + pos_emb)))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))


def build(vocab_size, block_size, n_layer, n_head, n_embd, bias=False, act="relu"):
    return GPTLanguageModel(vocab_size, block_size, n_layer, n_head, n_embd, bias, act)


def logits(model, idx):
    return model(idx)[0]


def hand_load(model, canonical):
    tok = _parts.put_ends(canonical, model.token_embedding_table.weight, model.position_embedding_table.weight,
                          model.ln_f)
    for i, blk in enumerate(model.blocks):
        t = _parts.put_block(canonical, i, ln1=blk.ln1, ln2=blk.ln2, proj=blk.sa.proj, fc=blk.ffwd.net[0],
                             mlp_proj=blk.ffwd.net[2])
        _parts.put_heads(blk.sa.heads, t)
    _parts.put_linear(model.lm_head, tok, torch.zeros(model.lm_head.out_features))
