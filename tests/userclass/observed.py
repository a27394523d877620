"""Classes the fourth round found unproven although they compute GPT-2, or refused with a cause they contradict: a
block is whatever the class calls it, with the arguments the class passes.

build(config, kind, **options) -> the class at a GPT-2 config's shape:

- "encoder": torch's nn.TransformerEncoderLayer (norm_first, batch_first), the causal mask passed by the model
  (act: "tanh" or "erf");
- "einops": lucidrains' style, blocks as nn.ModuleList([attn, ff]) pairs called `x = attn(x) + x; x = ff(x) + x`,
  heads split with einops (qkv: "chunk" or "interleaved", the (h three d) order of one fused projection);
- "einsum": "LLMs from scratch" chapter 3's attention, raw (d_in, d_out) W_query/W_key/W_value Parameters with
  bias_q/bias_k/bias_v, einsum;
- "targets": nanoGPT's shell whose forward requires targets;
- "module" with a `plant` (the misleading diagnoses): "normed_residual" (the residual added from the normed input),
  "parallel" (NeoX: attention and MLP both from the block's input), "dropout" (SDPA with dropout_p=0.1 in eval).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange


class Attention(nn.Module):
    """nanoGPT's fused attention through SDPA (dropout_p as the class passes it)."""

    def __init__(self, C, H, dropout_p=0.0):
        super().__init__()
        self.n_head, self.dropout_p = H, dropout_p
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout_p)  # dropout even in eval
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, C, H, P, plant=None):
        super().__init__()
        self.plant = plant
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn = Attention(C, H, 0.1 if plant == "dropout" else 0.0)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(approximate="tanh"), nn.Linear(4 * C, C))

    def forward(self, x):
        if self.plant == "parallel":  # GPT-NeoX / GPT-J: both branches read the block's input
            return x + self.attn(self.ln_1(x)) + self.mlp(self.ln_2(x))
        if self.plant == "normed_residual":  # the residual taken after the norm
            h = self.ln_1(x)
            x = h + self.attn(h)
            h = self.ln_2(x)
            return h + self.mlp(h)
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class EinopsAttention(nn.Module):
    def __init__(self, C, H, qkv="chunk"):
        super().__init__()
        self.heads, self.qkv = H, qkv
        self.norm = nn.LayerNorm(C)
        self.to_qkv, self.to_out = nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, x):
        x = self.norm(x)
        if self.qkv == "interleaved":  # one projection read as (h three d): each head's q, k, v side by side
            q, k, v = rearrange(self.to_qkv(x), "b n (h three d) -> three b h n d", h=self.heads, three=3)
        else:
            q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.heads) for t in self.to_qkv(x).chunk(3, dim=-1))
        dots = torch.einsum("bhid,bhjd->bhij", q, k) * q.shape[-1] ** -0.5
        n = x.shape[1]
        dots = dots.masked_fill(torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        out = torch.einsum("bhij,bhjd->bhid", dots.softmax(dim=-1), v)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


class FeedForward(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(C), nn.Linear(C, 4 * C), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * C, C))

    def forward(self, x):
        return self.net(x)


class EinsumAttention(nn.Module):
    """The book's chapter-3 attention with raw Parameters: x @ W_query + bias_q, (d_in, d_out)."""

    def __init__(self, C, H):
        super().__init__()
        self.num_heads = H
        self.W_query, self.W_key, self.W_value = (nn.Parameter(torch.randn(C, C) * 0.02) for _ in range(3))
        self.bias_q, self.bias_k, self.bias_v = (nn.Parameter(torch.zeros(C)) for _ in range(3))
        self.out_proj = nn.Linear(C, C)

    def forward(self, x):
        B, T, C = x.shape
        H = self.num_heads
        q = (torch.einsum("btc,cd->btd", x, self.W_query) + self.bias_q).view(B, T, H, -1)
        k = (torch.einsum("btc,cd->btd", x, self.W_key) + self.bias_k).view(B, T, H, -1)
        v = (torch.einsum("btc,cd->btd", x, self.W_value) + self.bias_v).view(B, T, H, -1)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(C // H)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = torch.einsum("bhqk,bkhd->bqhd", s.softmax(dim=-1), v).reshape(B, T, C)
        return self.out_proj(y)


class Unpaired(EinsumAttention):
    """Biases named for nothing (c1, c2, c3), added per head after the product's reshape: no name or addition
    pairs them with a weight."""

    def __init__(self, C, H):
        super().__init__(C, H)
        del self.bias_q, self.bias_k, self.bias_v
        self.c1, self.c2, self.c3 = (nn.Parameter(torch.zeros(C)) for _ in range(3))

    def forward(self, x):
        B, T, C = x.shape
        H = self.num_heads
        q, k, v = ((x @ w).view(B, T, H, -1) + c.view(H, -1) for w, c in
                   ((self.W_query, self.c1), (self.W_key, self.c2), (self.W_value, self.c3)))
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(C // H)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        return self.out_proj(torch.einsum("bhqk,bkhd->bqhd", s.softmax(dim=-1), v).reshape(B, T, C))


class EinsumBlock(Block):
    def __init__(self, C, H, P, unpaired=False):
        super().__init__(C, H, P)
        self.attn = (Unpaired if unpaired else EinsumAttention)(C, H)


class GPT(nn.Module):
    """nanoGPT's shell around one kind of block; kind "einops" keeps (attn, ff) pairs, "encoder" torch's layers."""

    def __init__(self, V, P, L, H, C, kind="module", act="tanh", qkv="chunk", **options):
        super().__init__()
        self.kind = kind
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(P, C)
        if kind == "encoder":
            gelu = (lambda x: F.gelu(x, approximate="tanh")) if act == "tanh" else "gelu"
            self.h = nn.ModuleList(nn.TransformerEncoderLayer(C, H, 4 * C, dropout=0.0, activation=gelu,
                                                              batch_first=True, norm_first=True) for _ in range(L))
        elif kind == "einops":
            self.h = nn.ModuleList(nn.ModuleList([EinopsAttention(C, H, qkv), FeedForward(C)]) for _ in range(L))
        elif kind == "einsum":
            self.h = nn.ModuleList(EinsumBlock(C, H, P, **options) for _ in range(L))
        else:
            self.h = nn.ModuleList(Block(C, H, P, **options) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        self.lm_head = nn.Linear(C, V, bias=False)
        self.lm_head.weight = self.wte.weight

    def body(self, idx):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        if self.kind == "encoder":
            mask = nn.Transformer.generate_square_subsequent_mask(T, device=idx.device)
            for layer in self.h:
                x = layer(x, src_mask=mask, is_causal=True)
        elif self.kind == "einops":
            for attn, ff in self.h:
                x = attn(x) + x
                x = ff(x) + x
        else:
            for block in self.h:
                x = block(x)
        return self.lm_head(self.ln_f(x))

    def forward(self, idx):
        return self.body(idx)


class TargetsGPT(GPT):
    """A forward that requires targets (a training-only signature): (logits, loss)."""

    def forward(self, idx, targets):
        logits = self.body(idx)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(config, kind="module", **options):
    torch.manual_seed(0)
    cls = TargetsGPT if kind == "targets" else GPT
    kind = "module" if kind == "targets" else kind
    return cls(config.vocab_size, config.n_positions, config.n_layer, config.n_head, config.n_embd, kind, **options)
