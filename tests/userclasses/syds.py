"""SydsGPT style: token_embedding/position_embedding, transformer_blocks as a Sequential, a hand-written LayerNorm
(scale, shift), FeedForward.layers as Sequential(Linear, GELU, Linear) with the tanh GELU written out, attention with
separate W_query/W_key/W_value (qkv_bias on, as a config meant for GPT-2's weights sets it) and an untied
output_projection without a bias."""

from __future__ import annotations

import torch
import torch.nn as nn

from tests.userclasses import _parts


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, num_heads, qkv_bias):
        super().__init__()
        self.num_heads = num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_projection = nn.Linear(d_out, d_out)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        queries = _parts.split_heads(self.W_query(x), self.num_heads)
        keys = _parts.split_heads(self.W_key(x), self.num_heads)
        values = _parts.split_heads(self.W_value(x), self.num_heads)
        # the mask here marks the future with ones; attend() wants ones where attention is allowed
        context = _parts.attend(queries, keys, values, 1 - self.mask)
        return self.out_projection(_parts.merge_heads(context))


class FeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config["embedding_dim"]
        self.layers = nn.Sequential(nn.Linear(d, 4 * d), _parts.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return self.layers(x)


class TransformerBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config["embedding_dim"]
        self.attention = MultiHeadAttention(d, d, config["context_length"], config["num_heads"], config["qkv_bias"])
        self.feed_forward = FeedForward(config)
        self.layer_norm1 = _parts.ScaleShiftLayerNorm(d)
        self.layer_norm2 = _parts.ScaleShiftLayerNorm(d)
        self.dropout = nn.Dropout(config["dropout"])

    def forward(self, x):
        shortcut = x
        x = shortcut + self.dropout(self.attention(self.layer_norm1(x)))
        shortcut = x
        return shortcut + self.dropout(self.feed_forward(self.layer_norm2(x)))


class SydsGPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config["vocab_size"], config["embedding_dim"])
        self.position_embedding = nn.Embedding(config["context_length"], config["embedding_dim"])
        self.drop_embedding = nn.Dropout(config["dropout"])
        self.transformer_blocks = nn.Sequential(*[TransformerBlock(config) for _ in range(config["num_layers"])])
        self.final_layer_norm = _parts.ScaleShiftLayerNorm(config["embedding_dim"])
        self.output_projection = nn.Linear(config["embedding_dim"], config["vocab_size"], bias=False)

    def forward(self, input):
        seq_len = input.shape[1]
        tokens = self.token_embedding(input)
        positions = self.position_embedding(torch.arange(seq_len, device=input.device))
        x = self.drop_embedding(tokens + positions)
        x = self.transformer_blocks(x)
        return self.output_projection(self.final_layer_norm(x))


def build(vocab_size, block_size, n_layer, n_head, n_embd, qkv_bias=True):
    return SydsGPT({"vocab_size": vocab_size, "context_length": block_size, "embedding_dim": n_embd,
                    "num_heads": n_head, "num_layers": n_layer, "dropout": 0.0, "qkv_bias": qkv_bias})


def logits(model, idx):
    return model(idx)


def hand_load(model, canonical):
    tok = _parts.put_ends(canonical, model.token_embedding.weight, model.position_embedding.weight,
                          model.final_layer_norm)
    for i, blk in enumerate(model.transformer_blocks):
        att, layers = blk.attention, blk.feed_forward.layers
        t = _parts.put_block(canonical, i, ln1=blk.layer_norm1, ln2=blk.layer_norm2, proj=att.out_projection,
                             fc=layers[0], mlp_proj=layers[2])
        _parts.put_linear(att.W_query, t["q.weight"], t["q.bias"])
        _parts.put_linear(att.W_key, t["k.weight"], t["k.bias"])
        _parts.put_linear(att.W_value, t["v.weight"], t["v.bias"])
    _parts.put(model.output_projection.weight, tok)  # untied: its own copy of the embedding
