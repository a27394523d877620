"""minGPT style: transformer as a ModuleDict(wte, wpe, drop, h, ln_f); blocks with ln_1, attn (c_attn fused, c_proj,
a `bias` mask buffer) and ln_2, the MLP itself a ModuleDict(c_fc, c_proj, act, dropout) with NewGELU written out;
an untied lm_head without a bias. forward(idx, targets=None) -> (logits over all positions, loss)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.userclasses import _parts


class NewGELU(nn.Module):
    def forward(self, x):
        return _parts.gelu_tanh(x)  # the formula minGPT writes out in this method


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(0.0)
        self.resid_dropout = nn.Dropout(0.0)
        self.register_buffer("bias", _parts.causal_mask(block_size))
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = self.attn_dropout(F.softmax(att, dim=-1)) @ v
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(n_embd, 4 * n_embd), c_proj=nn.Linear(4 * n_embd, n_embd),
                                      act=NewGELU(), dropout=nn.Dropout(0.0)))
        m = self.mlp
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlpf(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(0.0),
            h=nn.ModuleList([Block(n_embd, n_head, block_size) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device).unsqueeze(0)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def build(vocab_size, block_size, n_layer, n_head, n_embd):
    return GPT(vocab_size, block_size, n_layer, n_head, n_embd)


def logits(model, idx):
    return model(idx)[0]


def hand_load(model, canonical):
    tf = model.transformer
    tok = _parts.put_ends(canonical, tf.wte.weight, tf.wpe.weight, tf.ln_f)
    for i, blk in enumerate(tf.h):
        _parts.put_block(canonical, i, ln1=blk.ln_1, ln2=blk.ln_2, qkv=blk.attn.c_attn, proj=blk.attn.c_proj,
                         fc=blk.mlp["c_fc"], mlp_proj=blk.mlp["c_proj"])
    _parts.put(model.lm_head.weight, tok)  # untied: a copy
