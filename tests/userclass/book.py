"""A GPT written as "LLMs from scratch" chapter 4 writes it, constant included: its GELU computes sqrt(2/pi) as
`torch.sqrt(torch.tensor(2.0 / torch.pi))`, a float32 tensor whichever dtype the input has; LayerNorm with
scale/shift and its own eps; W_query/W_key/W_value and out_proj; a triu(1) mask buffer; an untied out_head.

`options` plants one thing at a time, for the tests of consistent answers: "unscaled" (no 1/sqrt(d)), "mask2"
(each position also sees the next), "post_ln" (the norm after the residual add), "eps" (a LayerNorm eps)."""

from __future__ import annotations

import torch
import torch.nn as nn


class LayerNorm(nn.Module):
    def __init__(self, emb_dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        norm_x = (x - mean) / torch.sqrt(var + self.eps)
        return self.scale * norm_x + self.shift


class GELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(torch.sqrt(torch.tensor(2.0 / torch.pi)) * (x + 0.044715 * torch.pow(x, 3))))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(cfg["emb_dim"], 4 * cfg["emb_dim"]), GELU(),
                                    nn.Linear(4 * cfg["emb_dim"], cfg["emb_dim"]))

    def forward(self, x):
        return self.layers(x)


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, options=()):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length),
                                                diagonal=2 if "mask2" in options else 1))
        self.options = options

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        scale = 1.0 if "unscaled" in self.options else keys.shape[-1] ** 0.5
        attn_weights = self.dropout(torch.softmax(attn_scores / scale, dim=-1))
        context_vec = (attn_weights @ values).transpose(1, 2)
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context_vec)


class TransformerBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.att = MultiHeadAttention(cfg["emb_dim"], cfg["emb_dim"], cfg["context_length"], cfg["drop_rate"],
                                      cfg["n_heads"], cfg["qkv_bias"], cfg.get("options", ()))
        self.ff = FeedForward(cfg)
        self.norm1 = LayerNorm(cfg["emb_dim"], cfg.get("eps", 1e-5))
        self.norm2 = LayerNorm(cfg["emb_dim"], cfg.get("eps", 1e-5))
        self.drop_shortcut = nn.Dropout(cfg["drop_rate"])
        self.post_ln = "post_ln" in cfg.get("options", ())

    def forward(self, x):
        if self.post_ln:
            x = self.norm1(x + self.drop_shortcut(self.att(x)))
            return self.norm2(x + self.drop_shortcut(self.ff(x)))
        shortcut = x
        x = self.norm1(x)
        x = self.att(x)
        x = self.drop_shortcut(x)
        x = x + shortcut
        shortcut = x
        x = self.norm2(x)
        x = self.ff(x)
        x = self.drop_shortcut(x)
        return x + shortcut


class GPTModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
        self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
        self.drop_emb = nn.Dropout(cfg["drop_rate"])
        self.trf_blocks = nn.Sequential(*[TransformerBlock(cfg) for _ in range(cfg["n_layers"])])
        self.final_norm = LayerNorm(cfg["emb_dim"], cfg.get("eps", 1e-5))
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)

    def forward(self, in_idx):
        batch_size, seq_len = in_idx.shape
        tok_embeds = self.tok_emb(in_idx)
        pos_embeds = self.pos_emb(torch.arange(seq_len, device=in_idx.device))
        x = self.drop_emb(tok_embeds + pos_embeds)
        x = self.trf_blocks(x)
        x = self.final_norm(x)
        return self.out_head(x)


def config(sizes: dict, **more) -> dict:
    """The book's GPT_CONFIG dict for sizes given as gpt2port's (vocab_size, n_embd, n_head, n_layer, n_positions);
    qkv_bias True as the book sets it to load GPT-2."""
    return {"vocab_size": sizes["vocab_size"], "context_length": sizes["n_positions"], "emb_dim": sizes["n_embd"],
            "n_heads": sizes["n_head"], "n_layers": sizes["n_layer"], "drop_rate": 0.0, "qkv_bias": True, **more}
