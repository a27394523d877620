"""The GPT-2 language model, written from scratch in plain PyTorch.

Token + learned position embeddings, a stack of pre-LayerNorm blocks (fused-qkv causal self-attention, then a
4x MLP), a final LayerNorm, and a head that is the token embedding itself (one Parameter, not a copy).
Parameter names are gpt2port's own and are the canonical names gpt2port/layouts maps every other layout onto.

The optional KVCache lets generation feed one new token per step instead of re-running the whole context.
Nothing here is tuned for speed: gpt2port.fast swaps faster kernels in from outside (see its docstring).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2port.checkpoint import load_state, save
from gpt2port.config import ACTIVATIONS, GPTConfig


class KVCache:
    """Keys and values of every layer for positions [0, length), preallocated up to max_len positions.

    pad (B,) int64, optional: how many positions at the start of each row are left padding, for a batch of prompts
    of different lengths. Padded positions are hidden from every real query, and a row's position embeddings count
    from its first real token, so each row computes what it would alone (GPT-2's positions are absolute, learned).
    """

    def __init__(self, config: GPTConfig, batch_size: int, max_len: int | None = None, dtype=None, device=None,
                 pad: torch.Tensor | None = None):
        self.max_len = max_len or config.n_positions
        shape = (config.n_layer, batch_size, config.n_head, self.max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.reset(pad)

    def reset(self, pad: torch.Tensor | None = None) -> None:
        """Empty the cache (keeping its memory) for a new batch of rows, padded as `pad` says."""
        self.length = 0
        self.pad = None if pad is None or not bool(pad.any()) else pad.to(device=self.k.device, dtype=torch.long)
        self._mask, self._mask_for = None, None  # the mask for (length, T): every layer of one step shares it

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v (B, H, T, D) for `layer`; return all keys and values so far."""
        end = self.length + k.size(2)
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def attn_mask(self, T: int, device) -> tuple[torch.Tensor | None, bool]:
        """(mask, is_causal) for SDPA when T new queries follow `length` cached positions; mask True = may attend."""
        past = self.length
        if self.pad is None:
            if past == 0 or T == 1:  # plain causal prefill, or one query that may see everything: no mask at all
                return None, T > 1
        if self._mask_for != (past, T):
            q = torch.arange(past, past + T, device=device).view(T, 1)
            k = torch.arange(past + T, device=device).view(1, past + T)
            mask = k <= q
            if self.pad is not None:
                # Hide padding from real queries. A padding query still sees itself, so no row of scores is all
                # masked: that would make NaNs which, multiplied by a zero weight later, would still be NaN.
                mask = mask & ((k >= self.pad.view(-1, 1, 1, 1)) | (k == q))
            self._mask, self._mask_for = mask, (past, T)
        return self._mask, False


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in that order, as GPT-2's c_attn
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        # GPT-2 scales scores by 1/sqrt(head_dim); a config may switch scaling off, which SDPA expresses as 1.0.
        self.scale = None if config.scale_attn_weights else 1.0
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, 3C) -> q, k, v, each (B, H, T, D): views, no copies
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4).unbind(0)
        mask, is_causal = None, T > 1
        if cache is not None:
            mask, is_causal = cache.attn_mask(T, x.device)
            k, v = cache.append(layer, k, v)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
        )
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.mlp_width)
        self.proj = nn.Linear(config.mlp_width, config.n_embd)
        self.act = ACTIVATIONS[config.activation]
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache, layer)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.checkpoint_dir: Path | None = None  # where from_pretrained loaded it from: save() carries its provenance
        self.quantized: str | None = None  # "int8" for a model whose matrices were quantized at load (gpt2port.quant)
        # _weight: no reset_parameters() here (_init_weights covers every parameter). On the meta device that init
        # is a normal_() which PyTorch decomposes through torch._dynamo: a 1 s import, and a stray /tmp directory.
        V, P, C = config.vocab_size, config.n_positions, config.n_embd
        self.tok_emb = nn.Embedding(V, C, _weight=torch.empty(V, C))
        self.pos_emb = nn.Embedding(P, C, _weight=torch.empty(P, C))
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.final_norm = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # tied: one Parameter, stored and counted once
        if self.tok_emb.weight.device.type != "meta":
            self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        # GPT-2's initialisation, for training from scratch; from_pretrained skips it (meta device).
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif name.endswith("proj.weight"):  # residual projections, scaled per the GPT-2 paper
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.config.n_layer))
            elif "norm" in name or ".ln" in name:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=0.02)

    def num_params(self) -> int:
        """Parameters counted once each: a tied head adds nothing to the token embedding."""
        return sum(p.numel() for p in self.parameters())

    def embed(self, idx: torch.Tensor, start_pos: int = 0, pad: torch.Tensor | None = None) -> torch.Tensor:
        T = idx.size(1)
        if start_pos + T > self.config.n_positions:
            raise ValueError(
                f"sequence of {start_pos + T} tokens exceeds the model's context of {self.config.n_positions}"
            )
        pos = torch.arange(start_pos, start_pos + T, device=idx.device)
        if pad is not None:  # left-padded rows count positions from their first real token (padding gets 0)
            pos = (pos.view(1, T) - pad.view(-1, 1)).clamp(min=0)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None,
                last_only: bool = False):
        """idx (B, T) int64 -> logits (B, T, vocab); with targets (B, T), returns (logits, mean cross-entropy).

        With a cache, idx holds only the new tokens; their positions continue from cache.length.
        last_only computes logits for the final position only (all generation needs).
        """
        x = self.embed(idx, cache.length, cache.pad) if cache is not None else self.embed(idx)
        for i, block in enumerate(self.blocks):
            x = block(x, cache, i)
        if cache is not None:
            cache.length += idx.size(1)
        if last_only:
            x = x[:, -1:, :]
        logits = self.lm_head(self.final_norm(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        return logits, loss

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | str | None = None,
                        device: torch.device | str | None = None) -> "GPT":
        """Load a converted checkpoint (a directory, or a NAME under ./checkpoints) without random init or copies:
        the model is built on the meta device and the file's memory-mapped tensors are assigned into it.
        dtype "int8": the matrices quantized to int8 as they load, for CPU inference (see gpt2port.quant)."""
        if dtype is torch.int8 or (isinstance(dtype, str) and dtype.lower() == "int8"):
            from gpt2port.quant import quantized_model

            return quantized_model(cls, path, device)
        ckpt_dir, config, state = load_state(path, dtype=dtype, device=device)
        with torch.device("meta"):
            model = cls(config)
        tied = config.tie_word_embeddings
        if tied:
            state["lm_head.weight"] = state["tok_emb.weight"]
        model.load_state_dict(state, assign=True, strict=True)
        if tied:
            model.lm_head.weight = model.tok_emb.weight  # assign made two Parameters of one tensor; make them one
        model.checkpoint_dir = ckpt_dir
        return model.eval()

    def save_pretrained(self, out: str | Path, dtype: torch.dtype | str | None = None, force: bool = False,
                        parent: str | Path | None = None) -> Path:
        """Write this model as a gpt2port checkpoint (see gpt2port.save)."""
        return save(self, out, dtype=dtype, force=force, parent=parent)
