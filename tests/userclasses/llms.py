"""LLMs-from-scratch style GPTModel: tok_emb/pos_emb, trf_blocks as a Sequential of TransformerBlock(att, ff, norm1,
norm2), attention with W_query/W_key/W_value (qkv_bias, off by default as in the book's configs) and out_proj, or
with fused=True the combined-qkv variant (att.qkv, att.proj); LayerNorm with scale/shift, FeedForward.layers as
Sequential(Linear, GELU, Linear) with the tanh GELU written out, an untied out_head without a bias."""

from __future__ import annotations

import torch
import torch.nn as nn

from tests.userclasses import _parts


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, n, _ = x.shape
        keys = _parts.split_heads(self.W_key(x), self.num_heads)
        queries = _parts.split_heads(self.W_query(x), self.num_heads)
        values = _parts.split_heads(self.W_value(x), self.num_heads)
        scores = queries @ keys.transpose(2, 3)
        scores.masked_fill_(self.mask.bool()[:n, :n], -torch.inf)
        weights = torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)
        return self.out_proj(_parts.merge_heads(weights @ values))


class MultiHeadAttentionCombinedQKV(nn.Module):
    def __init__(self, d_in, d_out, context_length, num_heads, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(d_in, 3 * d_out, bias=qkv_bias)
        self.proj = nn.Linear(d_out, d_out)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, n, d = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        queries, keys, values = qkv.unbind(0)
        scores = (queries @ keys.transpose(-2, -1)).masked_fill(self.mask.bool()[:n, :n], -torch.inf)
        weights = torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)
        return self.proj(_parts.merge_heads(weights @ values))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(cfg["emb_dim"], 4 * cfg["emb_dim"]), _parts.GELU(),
                                    nn.Linear(4 * cfg["emb_dim"], cfg["emb_dim"]))

    def forward(self, x):
        return self.layers(x)


class TransformerBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        attention = MultiHeadAttentionCombinedQKV if cfg["fused"] else MultiHeadAttention
        self.att = attention(cfg["emb_dim"], cfg["emb_dim"], cfg["context_length"], cfg["n_heads"], cfg["qkv_bias"])
        self.ff = FeedForward(cfg)
        self.norm1 = _parts.ScaleShiftLayerNorm(cfg["emb_dim"])
        self.norm2 = _parts.ScaleShiftLayerNorm(cfg["emb_dim"])
        self.drop_shortcut = nn.Dropout(cfg["drop_rate"])

    def forward(self, x):
        x = x + self.drop_shortcut(self.att(self.norm1(x)))
        return x + self.drop_shortcut(self.ff(self.norm2(x)))


class GPTModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
        self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
        self.drop_emb = nn.Dropout(cfg["drop_rate"])
        self.trf_blocks = nn.Sequential(*[TransformerBlock(cfg) for _ in range(cfg["n_layers"])])
        self.final_norm = _parts.ScaleShiftLayerNorm(cfg["emb_dim"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)

    def forward(self, in_idx):
        seq_len = in_idx.shape[1]
        x = self.tok_emb(in_idx) + self.pos_emb(torch.arange(seq_len, device=in_idx.device))
        x = self.trf_blocks(self.drop_emb(x))
        return self.out_head(self.final_norm(x))


def build(vocab_size, block_size, n_layer, n_head, n_embd, qkv_bias=False, fused=False):
    return GPTModel({"vocab_size": vocab_size, "context_length": block_size, "emb_dim": n_embd, "n_heads": n_head,
                     "n_layers": n_layer, "drop_rate": 0.0, "qkv_bias": qkv_bias, "fused": fused})


def logits(model, idx):
    return model(idx)


def hand_load(model, canonical):
    """What the book's load_weights_into_gpt does, from gpt2port's canonical tensors instead of TF's."""
    tok = _parts.put_ends(canonical, model.tok_emb.weight, model.pos_emb.weight, model.final_norm)
    fused = model.cfg["fused"]
    for i, blk in enumerate(model.trf_blocks):
        att = blk.att
        t = _parts.put_block(canonical, i, ln1=blk.norm1, ln2=blk.norm2, qkv=att.qkv if fused else None,
                             proj=att.proj if fused else att.out_proj, fc=blk.ff.layers[0],
                             mlp_proj=blk.ff.layers[2])
        if not fused:
            for linear, kind in ((att.W_query, "q"), (att.W_key, "k"), (att.W_value, "v")):
                _parts.put_linear(linear, t[f"{kind}.weight"], t[f"{kind}.bias"])
    _parts.put(model.out_head.weight, tok)
