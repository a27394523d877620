"""nanoGPT style (model.py): transformer as a ModuleDict(wte, wpe, drop, h, ln_f), blocks ln_1/attn/ln_2/mlp with a
fused c_attn and c_proj, an MLP of c_fc, GELU and c_proj, a LayerNorm with an optional bias, lm_head tied to wte.
nn.GELU() is the exact erf form by default (gelu="erf"), which is not quite GPT-2's tanh form; gelu="tanh" is the
fix. forward(idx, targets=None) -> (logits, loss), and without targets only the last position's logits."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.userclasses import _parts


class LayerNorm(nn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, bias):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(0.0)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (_parts.split_heads(t, self.n_head) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(_parts.merge_heads(y)))


class MLP(nn.Module):
    def __init__(self, n_embd, bias, gelu):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU() if gelu == "erf" else nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, bias, gelu):
        super().__init__()
        self.ln_1 = LayerNorm(n_embd, bias)
        self.attn = CausalSelfAttention(n_embd, n_head, bias)
        self.ln_2 = LayerNorm(n_embd, bias)
        self.mlp = MLP(n_embd, bias, gelu)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, bias=True, gelu="erf"):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(0.0),
            h=nn.ModuleList([Block(n_embd, n_head, bias, gelu) for _ in range(n_layer)]),
            ln_f=LayerNorm(n_embd, bias),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])  # inference: only the last position is needed
            loss = None
        return logits, loss


def build(vocab_size, block_size, n_layer, n_head, n_embd, gelu="erf", bias=True):
    return GPT(vocab_size, block_size, n_layer, n_head, n_embd, bias=bias, gelu=gelu)


def logits(model, idx):
    """All positions' logits: nanoGPT computes them only when given targets."""
    return model(idx, targets=idx)[0]


def hand_load(model, canonical):
    tf = model.transformer
    _parts.put_ends(canonical, tf.wte.weight, tf.wpe.weight, tf.ln_f)  # lm_head is wte
    for i, blk in enumerate(tf.h):
        _parts.put_block(canonical, i, ln1=blk.ln_1, ln2=blk.ln_2, qkv=blk.attn.c_attn, proj=blk.attn.c_proj,
                         fc=blk.mlp.c_fc, mlp_proj=blk.mlp.c_proj)
