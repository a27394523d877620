"""Adversarial: every projection is a raw nn.Parameter stored (in, out) and applied as x @ W + b, the way HF's
Conv1D stores GPT-2, under names that are no known layout's. The attention output weight is (C, C): its shape
cannot tell it from its transpose. Embeddings are raw tables too and the head is x @ tokens.T."""

from __future__ import annotations

import torch
import torch.nn as nn

from tests.userclasses import _parts


def _param(*shape):
    return nn.Parameter(torch.randn(*shape) * 0.02)


class Attention(nn.Module):
    def __init__(self, width, n_head):
        super().__init__()
        self.n_head = n_head
        self.w_in, self.b_in = _param(width, 3 * width), _param(3 * width)
        self.w_out, self.b_out = _param(width, width), _param(width)

    def forward(self, x):
        q, k, v = (x @ self.w_in + self.b_in).chunk(3, dim=-1)
        y = torch.nn.functional.scaled_dot_product_attention(
            *(_parts.split_heads(t, self.n_head) for t in (q, k, v)), is_causal=True)
        return _parts.merge_heads(y) @ self.w_out + self.b_out


class FeedForward(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.w_up, self.b_up = _param(width, 4 * width), _param(4 * width)
        self.w_down, self.b_down = _param(4 * width, width), _param(width)

    def forward(self, x):
        return _parts.gelu_tanh(x @ self.w_up + self.b_up) @ self.w_down + self.b_down


class Block(nn.Module):
    def __init__(self, width, n_head):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(width), Attention(width, n_head)
        self.norm2, self.mlp = nn.LayerNorm(width), FeedForward(width)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.tokens = _param(vocab_size, n_embd)
        self.positions = _param(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.norm_out = nn.LayerNorm(n_embd)

    def forward(self, idx):
        x = self.tokens[idx] + self.positions[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.norm_out(x) @ self.tokens.T


def build(vocab_size, block_size, n_layer, n_head, n_embd):
    return Model(vocab_size, block_size, n_layer, n_head, n_embd)


def logits(model, idx):
    return model(idx)


def hand_load(model, canonical):
    _parts.put_ends(canonical, model.tokens, model.positions, model.norm_out)
    for i, b in enumerate(model.blocks):
        t = _parts.block(canonical, i)
        _parts.put_norm(b.norm1, canonical, f"blocks.{i}.ln1")
        _parts.put_norm(b.norm2, canonical, f"blocks.{i}.ln2")
        # canonical weights are (out, in); this class stores (in, out)
        for w, b_, name in ((b.attn.w_in, b.attn.b_in, "attn.qkv"), (b.attn.w_out, b.attn.b_out, "attn.proj"),
                            (b.mlp.w_up, b.mlp.b_up, "mlp.fc"), (b.mlp.w_down, b.mlp.b_down, "mlp.proj")):
            _parts.put(w, t[f"{name}.weight"].T)
            _parts.put(b_, t[f"{name}.bias"])
