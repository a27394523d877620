"""Adversarial: names tell nothing. Attention keeps its three projections in a ModuleList `lin` and uses them as
key, query, value in that order (not q, k, v); the MLP is `ff`; the head reuses the embedding through F.linear
(tied, no head module at all). Only running the class can say which Linear is which."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.userclasses import _parts


class Mix(nn.Module):
    def __init__(self, width, n_head, block_size):
        super().__init__()
        self.n_head = n_head
        self.lin = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)
        self.register_buffer("m", _parts.causal_mask(block_size), persistent=False)

    def forward(self, x):
        k = _parts.split_heads(self.lin[0](x), self.n_head)
        q = _parts.split_heads(self.lin[1](x), self.n_head)
        v = _parts.split_heads(self.lin[2](x), self.n_head)
        return self.out(_parts.merge_heads(_parts.attend(q, k, v, self.m)))


class Layer(nn.Module):
    def __init__(self, width, n_head, block_size):
        super().__init__()
        self.n1 = nn.LayerNorm(width)
        self.mix = Mix(width, n_head, block_size)
        self.n2 = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.mix(self.n1(x))
        return x + self.ff(self.n2(x))


class Net(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.block_size = block_size
        self.emb = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.layers = nn.ModuleList(Layer(n_embd, n_head, block_size) for _ in range(n_layer))
        self.norm = nn.LayerNorm(n_embd)

    def forward(self, idx):
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x = layer(x)
        return F.linear(self.norm(x), self.emb.weight)


def build(vocab_size, block_size, n_layer, n_head, n_embd):
    return Net(vocab_size, block_size, n_layer, n_head, n_embd)


def logits(model, idx):
    return model(idx)


def hand_load(model, canonical):
    _parts.put_ends(canonical, model.emb.weight, model.pos.weight, model.norm)
    for i, layer in enumerate(model.layers):
        t = _parts.put_block(canonical, i, ln1=layer.n1, ln2=layer.n2, proj=layer.mix.out, fc=layer.ff[0],
                             mlp_proj=layer.ff[2])
        for linear, kind in zip(layer.mix.lin, "kqv"):  # the order forward() uses them in
            _parts.put_linear(linear, t[f"{kind}.weight"], t[f"{kind}.bias"])
