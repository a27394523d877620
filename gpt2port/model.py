"""The GPT-2 language model, written from scratch in plain PyTorch.

Token + learned position embeddings, a stack of pre-LayerNorm blocks (fused-qkv causal self-attention, then a
4x MLP), a final LayerNorm, and a head that is the token embedding itself (one Parameter, not a copy).
Parameter names are gpt2port's own and are the canonical names gpt2port/layouts maps every other layout onto.

The optional KVCache lets generation feed one new token per step instead of re-running the whole context: the
cache and the position are arguments of forward, so a decode step is this forward, nothing else. PastKV is the same
cache as plain tensors that grow by concatenation, with positions and padding given as tensors: what
torch.export captures (no Python reads a tensor's value on that path), and what an exported graph takes and returns
(gpt2port/targets/onnx.py). Nothing here is tuned for speed: gpt2port.fast replaces layers and the cache with ones
that compute the same on faster kernels, from outside (see its docstring).

The file needs only torch, the config and the error type: the checkpoint code is imported inside from_pretrained and
save_pretrained, so model.py can be lifted out on its own, as nanoGPT's can.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2port.config import ACTIVATIONS, GPTConfig
from gpt2port.errors import GPT2PortError


class KVCache:
    """Keys and values of every layer, preallocated for max_len positions; the model's forward writes and reads it at
    the position it is given (GPT.forward's `pos`), so one call is one step, whatever came before.

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
        """A new batch of rows, padded as `pad` says (the memory is kept; what is written over it starts at 0)."""
        self.pad = None if pad is None or not bool(pad.any()) else pad.to(device=self.k.device, dtype=torch.long)
        self._mask, self._mask_for = None, None  # the mask for (pos, T): every layer of one step shares it

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int | torch.Tensor,
               scale: float | None) -> torch.Tensor:
        """Store k, v (B, H, T, D) at positions pos.. of `layer`, and return the attention of q (B, H, T, D) over
        every position up to each query's own. pos a tensor (1,): the same over every slot of the cache, masked, so
        that shapes do not change from step to step (what a CUDA graph records)."""
        T = q.size(2)
        if isinstance(pos, torch.Tensor):
            at = pos + torch.arange(T, device=pos.device)
            self.k[layer].index_copy_(2, at, k)
            self.v[layer].index_copy_(2, at, v)
            slots = torch.arange(self.max_len, device=pos.device)
            mask = self._hide_padding(slots.view(1, -1) <= at.view(-1, 1), slots, at)
            return F.scaled_dot_product_attention(q, self.k[layer], self.v[layer], attn_mask=mask, scale=scale)
        end = pos + T
        if end > self.max_len:
            raise GPT2PortError(f"the KV cache holds {self.max_len} positions; writing {T} at {pos} overflows it")
        self.k[layer, :, :, pos:end] = k
        self.v[layer, :, :, pos:end] = v
        mask, is_causal = self._mask_at(pos, T, q.device)
        return F.scaled_dot_product_attention(q, self.k[layer, :, :, :end], self.v[layer, :, :, :end],
                                              attn_mask=mask, is_causal=is_causal, scale=scale)

    def _mask_at(self, pos: int, T: int, device) -> tuple[torch.Tensor | None, bool]:
        """(mask, is_causal) for SDPA when T new queries follow `pos` cached positions; mask True = may attend."""
        if self.pad is None and (pos == 0 or T == 1):  # plain causal prefill, or one query that sees everything
            return None, T > 1
        if self._mask_for != (pos, T):
            q = torch.arange(pos, pos + T, device=device)
            self._mask = self._hide_padding(torch.arange(pos + T, device=device).view(1, -1) <= q.view(T, 1),
                                            torch.arange(pos + T, device=device), q)
            self._mask_for = (pos, T)
        return self._mask, False

    def _hide_padding(self, causal: torch.Tensor, slots: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        real = None if self.pad is None else slots.view(1, -1) >= self.pad.view(-1, 1)
        return hide_padding(causal, slots, q, real)


def hide_padding(causal: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """causal (T, S) bool, with each row's padding hidden: (B, 1, T, S); real (B, S) bool marks the slots that hold a
    real token (None: all do). A padding query still sees itself, so no row of scores is all masked: that would make
    NaNs which, times a zero weight later, would still be NaN."""
    if real is None:
        return causal
    return causal & (real.view(real.size(0), 1, 1, -1) | (slots.view(1, -1) == q.view(-1, 1)))


@dataclass
class PastKV:
    """The KV cache as plain tensors (transformers' DynamicCache; optimum's past_key_values.{i}.key/value in,
    present.{i}.key/value out): forward appends each layer's new keys and values to k[i], v[i] (B, H, S, D), so after
    a call they hold the cache to pass to the next one. S = 0 is an empty cache. Positions come whole (forward's pos:
    (B, T) position ids), so nothing here counts; a shape is the only thing read, never a tensor's value.

    mask (B, S + T) bool, optional: which positions, past and new, hold a real token (transformers' attention_mask);
    padding is hidden from every real query as KVCache hides it.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    mask: torch.Tensor | None = None
    pad = None  # not a field: positions are given, not counted from each row's padding (forward reads cache.pad)

    @classmethod
    def empty(cls, config: GPTConfig, batch_size: int, dtype=None, device=None) -> "PastKV":
        shape = (batch_size, config.n_head, 0, config.head_dim)
        return cls(*([torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)] for _ in "kv"))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos, scale: float | None):
        """Append k, v (B, H, T, D) to `layer`'s cache; the attention of q (B, H, T, D) over it, each new query seeing
        every slot up to its own (the last T)."""
        self.k[layer] = torch.cat((self.k[layer], k), dim=2)
        self.v[layer] = torch.cat((self.v[layer], v), dim=2)
        S = self.k[layer].size(2)
        slots = torch.arange(S, device=q.device)
        at = slots[S - q.size(2):]  # the new queries' slots
        mask = hide_padding(slots.view(1, -1) <= at.view(-1, 1), slots, at, self.mask)
        return F.scaled_dot_product_attention(q, self.k[layer], self.v[layer], attn_mask=mask, scale=scale)


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

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0,
                pos: int | torch.Tensor = 0) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, 3C) -> q, k, v, each (B, H, T, D): views, no copies
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4).unbind(0)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, scale=self.scale,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:
            y = cache.attend(layer, q, k, v, pos, self.scale)
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

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0,
                pos: int | torch.Tensor = 0) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache, layer, pos)
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

    def embed(self, idx: torch.Tensor, pos: int | torch.Tensor = 0, pad: torch.Tensor | None = None) -> torch.Tensor:
        """Token plus position embeddings. pos: the first token's position (an int or a (1,) tensor), or (B, T)
        position ids, taken as they are."""
        V, P = self.config.vocab_size, self.config.n_positions
        if idx.dim() != 2 or idx.dtype not in (torch.long, torch.int) or idx.size(1) == 0:
            raise GPT2PortError(f"idx must be (batch, tokens) integer token ids; got {tuple(idx.shape)} {idx.dtype}")
        T = idx.size(1)
        if isinstance(pos, int) and pos + T > P:
            raise GPT2PortError(f"sequence of {pos + T} tokens exceeds the model's context of {P}")
        # Checked on the CPU (elsewhere: a sync per call), not under torch.compile (a captured forward replays no
        # Python; generation's ids come from the vocabulary)
        checked = idx.device.type == "cpu" and not (torch.compiler.is_compiling() or torch.compiler.is_exporting())
        if checked and not 0 <= int(idx.min()) <= int(idx.max()) < V:
            raise GPT2PortError(f"token ids {int(idx.min())}..{int(idx.max())} are outside the vocabulary (0..{V - 1})")
        if isinstance(pos, torch.Tensor) and pos.dim() == 2:
            positions = pos
        else:
            positions = pos + torch.arange(T, device=idx.device)
        if pad is not None:  # left-padded rows count positions from their first real token (padding gets 0)
            positions = (positions.view(1, T) - pad.view(-1, 1)).clamp(min=0)
        return self.drop(self.tok_emb(idx) + self.pos_emb(positions))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | PastKV | None = None,
                pos: int | torch.Tensor = 0, logits_to_keep: int | torch.Tensor = 0,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) int64 -> (logits (B, T, vocab), loss): the mean cross-entropy against targets (B, T), or None.

        With a cache, idx holds the tokens at positions pos.. (their keys and values are stored there; attention
        sees every position before them): a prompt at pos 0, then one token per call. pos may be a (1,) tensor (a
        static-shape step, as a CUDA graph records it). With a PastKV, pos is (B, T) position ids.

        logits_to_keep (as transformers names it): 0 computes the logits at every position; k > 0 at the last k only
        (1: the next token's); a (B, K) index tensor at the K positions it names in each row, giving (B, K, vocab).
        The head is a third of a forward's work at 124M: generation and evaluation ask only for what they read.
        """
        x = self.embed(idx, pos, None if cache is None else cache.pad)
        for i, block in enumerate(self.blocks):
            x = block(x, cache, i, pos)
        if isinstance(logits_to_keep, torch.Tensor):
            x = x.gather(1, logits_to_keep.unsqueeze(-1).expand(-1, -1, x.size(-1)))
        elif logits_to_keep:
            x = x[:, -logits_to_keep:, :]
        logits = self.lm_head(self.final_norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        return logits, loss

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | str | None = None,
                        device: torch.device | str | None = None) -> "GPT":
        """Load a converted checkpoint (a directory, or a NAME under ./checkpoints) without random init or copies:
        the model is built on the meta device and the file's memory-mapped tensors are assigned into it.
        dtype "int8": the matrices quantized to int8 as they load, for CPU inference (see gpt2port.quant)."""
        from gpt2port.checkpoint import load_state

        if dtype is torch.int8 or (isinstance(dtype, str) and dtype.lower() == "int8"):
            from gpt2port.quant import quantized_model

            return quantized_model(cls, path, device)
        ckpt_dir, config, state = load_state(path, dtype=dtype, device=device)
        model = cls.from_state(config, state)
        model.checkpoint_dir = ckpt_dir
        return model

    @classmethod
    def from_state(cls, config: GPTConfig, state: dict[str, torch.Tensor]) -> "GPT":
        """A model (in eval mode) holding the tensors of `state`, by their names here (a tied head's once, under
        tok_emb.weight): built on the meta device and the tensors assigned into it, no random init, no copies."""
        with torch.device("meta"):
            model = cls(config)
        tied = config.tie_word_embeddings
        if tied:
            state = {**state, "lm_head.weight": state["tok_emb.weight"]}
        model.load_state_dict(state, assign=True, strict=True)
        if tied:
            model.lm_head.weight = model.tok_emb.weight  # assign made two Parameters of one tensor; make them one
        return model.eval()

    def save_pretrained(self, out: str | Path, dtype: torch.dtype | str | None = None, force: bool = False,
                        parent: str | Path | None = None) -> Path:
        """Write this model as a gpt2port checkpoint (see gpt2port.save)."""
        from gpt2port.checkpoint import save

        return save(self, out, dtype=dtype, force=force, parent=parent)
