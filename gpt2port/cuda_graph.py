"""Decoding on a GPU by replaying one recorded CUDA graph per token instead of launching each kernel from Python.

One token's step on a GPU is a few hundred small kernels (~15 per block: 12 blocks at 124M, 48 at 1.5B), each doing
microseconds of work, and launched one by one from Python each costs more than it computes: the step is bound by
launches, not by memory. A CUDA graph records the step's kernels once, when a generation starts, and replays all of
them with a single launch per token.

A graph replays fixed kernels on fixed memory, so the step recorded here has fixed shapes. The KV cache is already
preallocated (KVCache); the position is a tensor on the device that the graph itself advances after each step; each
layer's new key and value are written at that position by index_copy_; attention spans every slot of the cache with
a mask that hides the slots past the position and each row's left padding, so the shapes never change. The step calls
the model's own modules for the embeddings, norms, products and MLPs; only the composition of a block and the
attention over the cache are written here, as Block and CausalSelfAttention compute them.

StaticStep runs on any device without a graph (how tests/test_cuda_graph.py checks its numbers on the CPU against the
model's forward); graphed_step() records it on a CUDA device. Recording costs two warm-up steps and the recording
itself, once per generation; a recording that fails costs only speed (the model's forward takes over, with a warning).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpt2port.model import GPT, CausalSelfAttention, KVCache

# Record the decode step on CUDA devices; a switch for comparisons and debugging (False: the model's forward), which
# the environment sets for the command line too: GPT2PORT_CUDA_GRAPH=0.
ENABLED = os.environ.get("GPT2PORT_CUDA_GRAPH", "1") != "0"


class StaticStep:
    """The decode step with fixed shapes and fixed memory: each call writes position `cache.length` of the cache for
    ids (B, 1) and returns the (B, vocab) logits of the next token, as model(ids, cache=cache, last_only=True) does
    (the caller advances cache.length). The inputs live in tensors of their own (ids, position, padding) that a
    recorded graph reads; sync() copies the cache's position and padding into them whenever a prefill or a reset
    moved them.
    """

    def __init__(self, model: GPT, cache: KVCache):
        self.model, self.cache = model, cache
        B, device = cache.k.size(1), cache.k.device
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros((), dtype=torch.long, device=device)  # the slot this step writes; its query's position
        self.pad = torch.zeros(B, dtype=torch.long, device=device)  # each row's left padding, 0 when there is none
        self.slots = torch.arange(cache.max_len, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # a recorded graph's output: rewritten by every replay
        self._pos_at: int | None = None  # the position self.pos holds, as far as this side knows
        self._pad_of: object = ()  # the cache.pad that self.pad was copied from (() : none yet)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.sync()
        self.ids.copy_(ids.view(-1, 1))
        if self.graph is not None:
            self.graph.replay()  # the step and the position's advance, recorded
            logits = self.logits.clone()  # the next replay overwrites the graph's output; the caller may keep this
        else:
            logits = self.forward()
            self.pos.add_(1)
        self._pos_at = self.cache.length + 1
        return logits

    def sync(self) -> None:
        cache = self.cache
        if self._pos_at != cache.length:  # a prefill ran (the first, or after the context slid)
            self.pos.fill_(cache.length)
            self._pos_at = cache.length
        if cache.pad is not self._pad_of:
            if cache.pad is None:
                self.pad.zero_()
            else:
                self.pad.copy_(cache.pad)
            self._pad_of = cache.pad

    def forward(self) -> torch.Tensor:
        """The step on self.ids at self.pos: what GPT.forward does for one new token per row, in eval mode."""
        m, B = self.model, self.ids.size(0)
        # left-padded rows count positions from their first real token, as GPT.embed
        x = m.drop(m.tok_emb(self.ids) + m.pos_emb((self.pos - self.pad).clamp(min=0)).unsqueeze(1))
        # (B, 1, 1, slots): the slots a row's query sees, up to its own and not its padding (a query's own position
        # is never padding: every row has at least one real token)
        visible = ((self.slots <= self.pos) & (self.slots >= self.pad.view(B, 1))).view(B, 1, 1, -1)
        for layer, block in enumerate(m.blocks):
            x = x + self._attend(block.attn, block.ln1(x), layer, visible)
            x = x + block.mlp(block.ln2(x))
        return m.lm_head(m.final_norm(x)).view(B, -1)

    def _attend(self, attn: CausalSelfAttention, x: torch.Tensor, layer: int, visible: torch.Tensor) -> torch.Tensor:
        B, _, C = x.shape
        q, k, v = attn.qkv(x).view(B, 1, 3, attn.n_head, C // attn.n_head).permute(2, 0, 3, 1, 4).unbind(0)
        keys, values = self.cache.k[layer], self.cache.v[layer]
        keys.index_copy_(2, self.pos.view(1), k)
        values.index_copy_(2, self.pos.view(1), v)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=attn.scale)
        return attn.resid_dropout(attn.proj(y.transpose(1, 2).reshape(B, 1, C)))

    def capture(self) -> None:
        """Record forward() and the position's advance as one CUDA graph; later calls replay it."""
        device = self.ids.device
        self.sync()
        # Warm up on a side stream first: cuBLAS and the attention kernels set up their workspaces on first use,
        # which must not happen while recording. The warm-up writes slot `pos` of the cache, which the first real
        # step writes again.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self.forward()
            self.pos.add_(1)
        self.graph = graph  # recording ran nothing: self.pos still holds cache.length


def graphed_step(model: GPT, cache: KVCache) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The recorded step for a model on a CUDA device (see the module's docstring), or None where recording failed.
    Which models StaticStep computes exactly is decode_step's question (decode_step.stepper asks it first)."""
    if not ENABLED or cache.k.device.type != "cuda":
        return None
    step = StaticStep(model, cache)
    try:
        step.capture()
    except Exception as e:  # noqa: BLE001 -- a graph that cannot be recorded only costs speed
        warnings.warn(f"gpt2port: decoding without a CUDA graph ({type(e).__name__}: {e})", stacklevel=3)
        return None
    return step
