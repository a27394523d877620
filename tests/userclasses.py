"""Users' own GPT classes, written fresh in the style of the tutorials gpt2port's users learn from and of the classes
they copy. load_into must read each from the module alone; none of these names appears in gpt2port.

Each builder takes (V vocab, P context, L layers, H heads, C width, **style options) and returns an nn.Module whose
forward takes ids (B, T) and returns what that style returns. `hand_load(model, canonical)` is what a learner's own
loader does, written out by hand from gpt2port's canonical tensors: an oracle independent of load_into.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


def gelu_tanh(x):  # GPT-2's GELU, written out as tutorials write it
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def heads(x, H):
    B, T, C = x.shape
    return x.view(B, T, H, C // H).transpose(1, 2)


def merge(y):
    B, H, T, D = y.shape
    return y.transpose(1, 2).reshape(B, T, H * D)


def masked_softmax_attention(q, k, v, mask):
    T = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])
    att = att.masked_fill(mask[:T, :T] == 0, float("-inf"))
    return F.softmax(att, dim=-1) @ v


# --- Kader, Day 7 (and gpt_mini: its attention has bias=False, its MLP has biases; head named `head`) -----------

class KaderAttention(nn.Module):
    def __init__(self, C, H, P, bias):
        super().__init__()
        self.n_head = H
        self.qkv = nn.Linear(C, 3 * C, bias=bias)
        self.proj = nn.Linear(C, C, bias=bias)
        self.attn_drop, self.resid_drop = nn.Dropout(0.0), nn.Dropout(0.0)
        self.register_buffer("mask", torch.tril(torch.ones(P, P)))

    def forward(self, x):
        q, k, v = self.qkv(x).split(x.shape[-1], dim=2)
        y = masked_softmax_attention(heads(q, self.n_head), heads(k, self.n_head), heads(v, self.n_head), self.mask)
        return self.resid_drop(self.proj(merge(y)))


class KaderMLP(nn.Module):
    def __init__(self, C, bias, gelu):
        super().__init__()
        self.fc, self.proj, self.drop = nn.Linear(C, 4 * C, bias=bias), nn.Linear(4 * C, C, bias=bias), nn.Dropout(0.0)
        self.gelu = gelu

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x), approximate=self.gelu)))


class KaderBlock(nn.Module):
    def __init__(self, C, H, P, attn_bias, mlp_bias, gelu):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(C), KaderAttention(C, H, P, attn_bias)
        self.ln2, self.mlp = nn.LayerNorm(C), KaderMLP(C, mlp_bias, gelu)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class KaderGPT(nn.Module):
    def __init__(self, V, P, L, H, C, bias=False, mlp_bias=None, gelu="none", head="lm_head"):
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = nn.Embedding(V, C), nn.Embedding(P, C), nn.Dropout(0.0)
        mlp_bias = bias if mlp_bias is None else mlp_bias
        self.blocks = nn.ModuleList(KaderBlock(C, H, P, bias, mlp_bias, gelu) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        self.head_name = head
        setattr(self, head, nn.Linear(C, V, bias=False))
        getattr(self, head).weight = self.tok_emb.weight  # weight tying

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = getattr(self, self.head_name)(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def kader(V, P, L, H, C, bias=False, gelu="none"):
    return KaderGPT(V, P, L, H, C, bias=bias, gelu=gelu)


def gpt_mini(V, P, L, H, C):
    return KaderGPT(V, P, L, H, C, bias=False, mlp_bias=True, gelu="tanh", head="head")


# --- SydsGPT: dict config, hand-written LayerNorm (scale/shift), Sequential blocks and feed-forward, untied head ---

class SydsLayerNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.scale, self.shift = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        return self.scale * (x - mean) / torch.sqrt(var + self.eps) + self.shift


class SydsGELU(nn.Module):
    def forward(self, x):
        return gelu_tanh(x)


class SydsAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, num_heads, qkv_bias):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        q, k, v = (heads(f(x), self.num_heads) for f in (self.W_query, self.W_key, self.W_value))
        y = masked_softmax_attention(q, k, v, 1 - self.mask)
        return self.out_proj(merge(y))


class SydsFeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config["embedding_dim"]
        self.layers = nn.Sequential(nn.Linear(d, 4 * d), SydsGELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return self.layers(x)


class SydsBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config["embedding_dim"]
        self.attention = SydsAttention(d, d, config["context_length"], config["num_heads"], config["qkv_bias"])
        self.feed_forward = SydsFeedForward(config)
        self.layer_norm1, self.layer_norm2 = SydsLayerNorm(d), SydsLayerNorm(d)
        self.dropout = nn.Dropout(config["dropout"])

    def forward(self, x):
        x = x + self.dropout(self.attention(self.layer_norm1(x)))
        return x + self.dropout(self.feed_forward(self.layer_norm2(x)))


class SydsGPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.token_embedding = nn.Embedding(config["vocab_size"], config["embedding_dim"])
        self.position_embedding = nn.Embedding(config["context_length"], config["embedding_dim"])
        self.drop_embedding = nn.Dropout(config["dropout"])
        self.transformer_blocks = nn.Sequential(*[SydsBlock(config) for _ in range(config["num_layers"])])
        self.final_layer_norm = SydsLayerNorm(config["embedding_dim"])
        self.output_projection = nn.Linear(config["embedding_dim"], config["vocab_size"], bias=False)

    def forward(self, x):
        T = x.shape[1]
        h = self.drop_embedding(self.token_embedding(x) + self.position_embedding(torch.arange(T, device=x.device)))
        return self.output_projection(self.final_layer_norm(self.transformer_blocks(h)))


def syds(V, P, L, H, C, qkv_bias=True):
    return SydsGPT({"vocab_size": V, "context_length": P, "num_layers": L, "num_heads": H, "embedding_dim": C,
                    "dropout": 0.0, "qkv_bias": qkv_bias})


# LLMs-from-scratch's GPTModel is the same shape under other names; its fused-qkv variant keeps one Linear.
class LLMsGPT(nn.Module):
    def __init__(self, cfg, fused=False):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
        self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
        self.drop_emb = nn.Dropout(cfg["drop_rate"])
        self.trf_blocks = nn.Sequential(*[LLMsBlock(cfg, fused) for _ in range(cfg["n_layers"])])
        self.final_norm = SydsLayerNorm(cfg["emb_dim"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)

    def forward(self, idx):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        return self.out_head(self.final_norm(self.trf_blocks(self.drop_emb(x))))


class FusedAttention(nn.Module):
    def __init__(self, d, num_heads, qkv_bias):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(d, 3 * d, bias=qkv_bias)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = (heads(t, self.num_heads) for t in self.qkv(x).chunk(3, dim=-1))
        return self.proj(merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


class LLMsBlock(nn.Module):
    def __init__(self, cfg, fused):
        super().__init__()
        d = cfg["emb_dim"]
        self.att = FusedAttention(d, cfg["n_heads"], cfg["qkv_bias"]) if fused else \
            SydsAttention(d, d, cfg["context_length"], cfg["n_heads"], cfg["qkv_bias"])
        self.ff = SydsFeedForward({"embedding_dim": d})
        self.norm1, self.norm2 = SydsLayerNorm(d), SydsLayerNorm(d)  # defined after use: order comes from running
        self.drop_shortcut = nn.Dropout(cfg["drop_rate"])

    def forward(self, x):
        x = x + self.drop_shortcut(self.att(self.norm1(x)))
        return x + self.drop_shortcut(self.ff(self.norm2(x)))


def llms(V, P, L, H, C, qkv_bias=False, fused=False):
    return LLMsGPT({"vocab_size": V, "context_length": P, "emb_dim": C, "n_heads": H, "n_layers": L,
                    "drop_rate": 0.0, "qkv_bias": qkv_bias}, fused=fused)


# --- The Opaque Box ch. 6 / the lecture style: one module per head, Sequential blocks, lm_head with a bias -------

class Head(nn.Module):
    def __init__(self, C, D, P, bias):
        super().__init__()
        self.key, self.query, self.value = (nn.Linear(C, D, bias=bias) for _ in range(3))
        self.register_buffer("tril", torch.tril(torch.ones(P, P)))

    def forward(self, x):
        k = self.key(x)  # k before q, as the lecture writes it
        q = self.query(x)
        return masked_softmax_attention(q, k, self.value(x), self.tril)


class MultiHeadAttention(nn.Module):
    def __init__(self, C, H, P, bias):
        super().__init__()
        self.heads = nn.ModuleList(Head(C, C // H, P, bias) for _ in range(H))
        self.proj, self.dropout = nn.Linear(C, C), nn.Dropout(0.0)

    def forward(self, x):
        return self.dropout(self.proj(torch.cat([h(x) for h in self.heads], dim=-1)))


class PerHeadBlock(nn.Module):
    def __init__(self, C, H, P, bias, act):
        super().__init__()
        self.sa = MultiHeadAttention(C, H, P, bias)
        self.ffwd = nn.Sequential(nn.Linear(C, 4 * C), act, nn.Linear(4 * C, C), nn.Dropout(0.0))
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)

    def forward(self, x):
        x = x + self.sa(self.ln1(x))
        return x + self.ffwd(self.ln2(x))


class PerHeadGPT(nn.Module):
    def __init__(self, V, P, L, H, C, bias=True, act="gelu_tanh"):
        super().__init__()
        act = {"relu": nn.ReLU(), "gelu_tanh": nn.GELU(approximate="tanh")}[act]
        self.token_embedding, self.position_embedding = nn.Embedding(V, C), nn.Embedding(P, C)
        self.blocks = nn.Sequential(*[PerHeadBlock(C, H, P, bias, act) for _ in range(L)])
        self.ln_f = nn.LayerNorm(C)
        self.lm_head = nn.Linear(C, V)  # keeps nn.Linear's default bias, which GPT-2's head does not have

    def forward(self, idx, targets=None):
        x = self.token_embedding(idx) + self.position_embedding(torch.arange(idx.shape[1], device=idx.device))
        logits = self.lm_head(self.ln_f(self.blocks(x)))
        return logits, None


def opaque(V, P, L, H, C):
    return PerHeadGPT(V, P, L, H, C)


def lecture(V, P, L, H, C, bias=False, act="relu"):
    return PerHeadGPT(V, P, L, H, C, bias=bias, act=act)


# --- nanoGPT and minGPT: HF's names in a ModuleDict, fused c_attn -------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.c_attn, self.c_proj, self.n_head = nn.Linear(C, 3 * C), nn.Linear(C, C), H

    def forward(self, x):
        q, k, v = (heads(t, self.n_head) for t in self.c_attn(x).split(x.shape[-1], dim=2))
        return self.c_proj(merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


class NanoMLP(nn.Module):
    def __init__(self, C, gelu):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(C, 4 * C), gelu, nn.Linear(4 * C, C)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class NanoBlock(nn.Module):
    def __init__(self, C, H, gelu):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(C), CausalSelfAttention(C, H), nn.LayerNorm(C), \
            NanoMLP(C, gelu)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NewGELU(nn.Module):
    def forward(self, x):
        return gelu_tanh(x)


class NanoGPT(nn.Module):
    def __init__(self, V, P, L, H, C, gelu="erf", tied=True):
        super().__init__()
        act = nn.GELU() if gelu == "erf" else NewGELU()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(V, C), wpe=nn.Embedding(P, C), drop=nn.Dropout(0.0),
            h=nn.ModuleList(NanoBlock(C, H, act) for _ in range(L)), ln_f=nn.LayerNorm(C)))
        self.lm_head = nn.Linear(C, V, bias=False)
        if tied:
            self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        t = self.transformer
        x = t.drop(t.wte(idx) + t.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for block in t.h:
            x = block(x)
        x = t.ln_f(x)
        if targets is None:  # inference: only the last position, as nanoGPT does
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def nanogpt(V, P, L, H, C, gelu="erf"):
    return NanoGPT(V, P, L, H, C, gelu=gelu)


def mingpt(V, P, L, H, C):
    return NanoGPT(V, P, L, H, C, gelu="tanh", tied=False)


# --- a nanochat-style model: not GPT-2 at all --------------------------------------------------------------------

class ChatAttention(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.n_head = H
        self.c_q, self.c_k, self.c_v, self.c_proj = (nn.Linear(C, C, bias=False) for _ in range(4))

    def forward(self, x):
        q, k, v = (heads(f(x), self.n_head) for f in (self.c_q, self.c_k, self.c_v))
        q, k = _rotate(q), _rotate(k)
        q, k = F.rms_norm(q, (q.shape[-1],)), F.rms_norm(k, (k.shape[-1],))
        return self.c_proj(merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


def _rotate(x):
    T, D = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, D // 2, device=x.device) / (D // 2)))
    ang = torch.arange(T, device=x.device)[:, None] * inv[None]
    a, b = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], dim=-1)


class ChatMLP(nn.Module):
    def __init__(self, C):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(C, 4 * C, bias=False), nn.Linear(4 * C, C, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class ChatBlock(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.attn, self.mlp = ChatAttention(C, H), ChatMLP(C)

    def forward(self, x):
        x = x + self.attn(F.rms_norm(x, (x.shape[-1],)))
        return x + self.mlp(F.rms_norm(x, (x.shape[-1],)))


class NanochatGPT(nn.Module):
    def __init__(self, V, L, H, C):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(V, C), h=nn.ModuleList(ChatBlock(C, H) for _ in range(L))))
        self.lm_head = nn.Linear(C, V, bias=False)

    def forward(self, idx):
        x = F.rms_norm(self.transformer.wte(idx), (self.lm_head.in_features,))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(F.rms_norm(x, (x.shape[-1],)))


def nanochat(V, P, L, H, C, vocab=65536):
    return NanochatGPT(vocab, L, H, C)


# --- hand-written loaders (the oracle) ---------------------------------------------------------------------------

@torch.no_grad()
def hand_load(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """What each style's own loader does, spelled out per class: canonical tensors (nn.Linear (out, in), q|k|v fused
    in that order) copied into the class's parameters."""
    C = sd["tok_emb.weight"].shape[1]

    def qkv(i):
        return sd[f"blocks.{i}.attn.qkv.weight"].split(C), sd[f"blocks.{i}.attn.qkv.bias"].split(C)

    def copy(p, t):
        p.copy_(t)

    def common(blocks, names):
        for i, b in enumerate(blocks):
            for ours, theirs in names(b).items():
                copy(ours, sd[theirs.format(i)])

    if isinstance(model, NanoGPT):
        t = model.transformer
        copy(t.wte.weight, sd["tok_emb.weight"]), copy(t.wpe.weight, sd["pos_emb.weight"])
        copy(model.lm_head.weight, sd["tok_emb.weight"])
        copy(t.ln_f.weight, sd["final_norm.weight"]), copy(t.ln_f.bias, sd["final_norm.bias"])
        common(t.h, lambda b: {
            b.ln_1.weight: "blocks.{}.ln1.weight", b.ln_1.bias: "blocks.{}.ln1.bias",
            b.attn.c_attn.weight: "blocks.{}.attn.qkv.weight", b.attn.c_attn.bias: "blocks.{}.attn.qkv.bias",
            b.attn.c_proj.weight: "blocks.{}.attn.proj.weight", b.attn.c_proj.bias: "blocks.{}.attn.proj.bias",
            b.ln_2.weight: "blocks.{}.ln2.weight", b.ln_2.bias: "blocks.{}.ln2.bias",
            b.mlp.c_fc.weight: "blocks.{}.mlp.fc.weight", b.mlp.c_fc.bias: "blocks.{}.mlp.fc.bias",
            b.mlp.c_proj.weight: "blocks.{}.mlp.proj.weight", b.mlp.c_proj.bias: "blocks.{}.mlp.proj.bias"})
    elif isinstance(model, (SydsGPT, LLMsGPT)):
        syd = isinstance(model, SydsGPT)
        tok, pos = (model.token_embedding, model.position_embedding) if syd else (model.tok_emb, model.pos_emb)
        final, head = (model.final_layer_norm, model.output_projection) if syd else (model.final_norm, model.out_head)
        blocks = model.transformer_blocks if syd else model.trf_blocks
        copy(tok.weight, sd["tok_emb.weight"]), copy(pos.weight, sd["pos_emb.weight"])
        copy(head.weight, sd["tok_emb.weight"])
        copy(final.scale, sd["final_norm.weight"]), copy(final.shift, sd["final_norm.bias"])
        for i, b in enumerate(blocks):
            att, ff, n1, n2 = (b.attention, b.feed_forward, b.layer_norm1, b.layer_norm2) if syd else \
                (b.att, b.ff, b.norm1, b.norm2)
            if isinstance(att, FusedAttention):
                copy(att.qkv.weight, sd[f"blocks.{i}.attn.qkv.weight"]), copy(att.qkv.bias, sd[f"blocks.{i}.attn.qkv.bias"])
                copy(att.proj.weight, sd[f"blocks.{i}.attn.proj.weight"]), copy(att.proj.bias, sd[f"blocks.{i}.attn.proj.bias"])
            else:
                (wq, wk, wv), (bq, bk, bv) = qkv(i)
                for lin, w, bias in ((att.W_query, wq, bq), (att.W_key, wk, bk), (att.W_value, wv, bv)):
                    copy(lin.weight, w), copy(lin.bias, bias)
                copy(att.out_proj.weight, sd[f"blocks.{i}.attn.proj.weight"])
                copy(att.out_proj.bias, sd[f"blocks.{i}.attn.proj.bias"])
            copy(n1.scale, sd[f"blocks.{i}.ln1.weight"]), copy(n1.shift, sd[f"blocks.{i}.ln1.bias"])
            copy(n2.scale, sd[f"blocks.{i}.ln2.weight"]), copy(n2.shift, sd[f"blocks.{i}.ln2.bias"])
            copy(ff.layers[0].weight, sd[f"blocks.{i}.mlp.fc.weight"]), copy(ff.layers[0].bias, sd[f"blocks.{i}.mlp.fc.bias"])
            copy(ff.layers[2].weight, sd[f"blocks.{i}.mlp.proj.weight"])
            copy(ff.layers[2].bias, sd[f"blocks.{i}.mlp.proj.bias"])
    elif isinstance(model, PerHeadGPT):
        H = len(model.blocks[0].sa.heads)
        copy(model.token_embedding.weight, sd["tok_emb.weight"]), copy(model.position_embedding.weight, sd["pos_emb.weight"])
        copy(model.lm_head.weight, sd["tok_emb.weight"]), model.lm_head.bias.zero_()
        copy(model.ln_f.weight, sd["final_norm.weight"]), copy(model.ln_f.bias, sd["final_norm.bias"])
        for i, b in enumerate(model.blocks):
            (wq, wk, wv), (bq, bk, bv) = qkv(i)
            for h, head in enumerate(b.sa.heads):
                for lin, w, bias in ((head.query, wq, bq), (head.key, wk, bk), (head.value, wv, bv)):
                    copy(lin.weight, w.chunk(H)[h]), copy(lin.bias, bias.chunk(H)[h])
            copy(b.sa.proj.weight, sd[f"blocks.{i}.attn.proj.weight"]), copy(b.sa.proj.bias, sd[f"blocks.{i}.attn.proj.bias"])
            for ln, n in ((b.ln1, "ln1"), (b.ln2, "ln2")):
                copy(ln.weight, sd[f"blocks.{i}.{n}.weight"]), copy(ln.bias, sd[f"blocks.{i}.{n}.bias"])
            copy(b.ffwd[0].weight, sd[f"blocks.{i}.mlp.fc.weight"]), copy(b.ffwd[0].bias, sd[f"blocks.{i}.mlp.fc.bias"])
            copy(b.ffwd[2].weight, sd[f"blocks.{i}.mlp.proj.weight"]), copy(b.ffwd[2].bias, sd[f"blocks.{i}.mlp.proj.bias"])
    elif isinstance(model, KaderGPT):
        copy(model.tok_emb.weight, sd["tok_emb.weight"]), copy(model.pos_emb.weight, sd["pos_emb.weight"])
        copy(model.ln_f.weight, sd["final_norm.weight"]), copy(model.ln_f.bias, sd["final_norm.bias"])
        common(model.blocks, lambda b: {
            b.ln1.weight: "blocks.{}.ln1.weight", b.ln1.bias: "blocks.{}.ln1.bias",
            b.attn.qkv.weight: "blocks.{}.attn.qkv.weight", b.attn.qkv.bias: "blocks.{}.attn.qkv.bias",
            b.attn.proj.weight: "blocks.{}.attn.proj.weight", b.attn.proj.bias: "blocks.{}.attn.proj.bias",
            b.ln2.weight: "blocks.{}.ln2.weight", b.ln2.bias: "blocks.{}.ln2.bias",
            b.mlp.fc.weight: "blocks.{}.mlp.fc.weight", b.mlp.fc.bias: "blocks.{}.mlp.fc.bias",
            b.mlp.proj.weight: "blocks.{}.mlp.proj.weight", b.mlp.proj.bias: "blocks.{}.mlp.proj.bias"})
    else:
        raise TypeError(type(model).__name__)
