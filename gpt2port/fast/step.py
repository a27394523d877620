"""The decode step: one new token per row through the model, with fixed shapes and fixed memory, on the CPU as it
is and on a GPU recorded once as a CUDA graph and replayed per token.

Why a step of its own: generating calls the model once per token, and on a GPU a step is a few hundred small kernels
each launched from Python, bound by launches rather than by memory; a CUDA graph records them once and replays them
with one launch. A graph replays fixed kernels on fixed memory, so the step has fixed shapes: the KV cache is
preallocated (KVCache); the position is a tensor that the step itself advances; each layer's new key and value are
written at that position by index_copy_; attention spans every slot of the cache with a mask that hides the slots
past the position and each row's left padding. On the CPU one sequence's attention runs instead on gpt2port's
one-token kernel where it is built (kernels.choose_attention), which writes the cache itself.

On the CPU a step is also a few hundred small operations, and for an int8 model (whose products are short) their
Python cost is a visible part of the step. So the step is bound once per generation (Step.bind): each layer's
product as the kernel the layer itself would take (kernels.bound_product, gpt2port.quant.Int8Linear.bound), each
norm's arguments, each layer's slice of the cache, all in one list walked per token; rows stay (B, C), residuals are
added in place, dropout (eval mode) is left out, and PyTorch's __torch_function__ lookup is switched off once for
the whole step. The embeddings and activations are the model's own; norms, products and attention are computed as
LayerNorm, the layers and CausalSelfAttention compute them, so `applies` asks that the model is built of those.
tests/fast/test_step.py holds the step to the model's forward, logits and cache, for every kernel, dtype, batch and
padding; on a GPU, scripts/gpu_check.sh records it.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2port.fast.kernels import bound_product, choose_attention
from gpt2port.fast.settings import Settings
from gpt2port.model import GPT, MLP, Block, CausalSelfAttention, KVCache
from gpt2port.quant import Int8Embedding


def applies(model: GPT, cache: KVCache) -> str | None:
    """None where the step computes exactly what the model's forward does for this model and cache, else why not: a
    GPT (not a subclass) of the model's own blocks, in eval mode, with no hooks (a step skips none, but a recorded
    graph replays kernels, never Python)."""
    if type(model) is not GPT:
        return f"a {type(model).__name__}, not a GPT"
    if any(m.training for m in model.modules()):
        return "the model is in training mode"
    if any(type(b) is not Block or type(b.attn) is not CausalSelfAttention or type(b.mlp) is not MLP
           for b in model.blocks):
        return "its blocks are not gpt2port's own"
    # The step computes norms, the position table and (in eval mode) dropout as these classes do, not by calling them
    norms = [model.final_norm] + [ln for b in model.blocks for ln in (b.ln1, b.ln2)]
    dropouts = [model.drop] + [d for b in model.blocks for d in (b.attn.resid_dropout, b.mlp.dropout)]
    if any(type(n) is not nn.LayerNorm for n in norms) or any(type(d) is not nn.Dropout for d in dropouts) or \
            type(model.pos_emb) is not nn.Embedding:
        return "its norms, dropouts or position table are not PyTorch's own"
    if hooked(model):
        return "it has forward hooks"
    return None


class Step:
    """Each call writes position cache.length of the cache for ids (B, 1), advances cache.length, and returns the
    (B, 1, vocab) logits of the next token, as model(ids, cache=cache, last_only=True) does. The inputs live in
    tensors of their own (ids, position, padding) that a recorded graph reads; they follow the cache's position and
    padding whenever a prefill or a slide moved them."""

    def __init__(self, model: GPT, cache: KVCache, settings: Settings):
        self.model, self.cache = model, cache
        B, device = cache.k.size(1), cache.k.device
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros((), dtype=torch.long, device=device)  # the slot this step writes; its query's position
        self.pad = torch.zeros(B, dtype=torch.long, device=device)  # each row's left padding, 0 when there is none
        self.slots = torch.arange(cache.max_len, device=device)
        self.kernel_attention = choose_attention(cache.k[0], settings)  # one unpadded sequence only (checked per call)
        self.bind()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # a recorded graph's output: rewritten by every replay
        self._pos_at: int | None = None  # the position self.pos holds, as far as this side knows
        self._pad_of: object = ()  # the cache.pad that self.pad was copied from (() : none yet)

    def bind(self) -> None:
        """What each step calls, looked up once per generation: per block, its norms' arguments, its products bound
        to their kernels (kernels.bound_product: the kernel the layer itself takes for B rows), its slice of the
        cache, its activation."""
        m, B = self.model, self.ids.size(0)
        dtype = (torch.float32 if isinstance(m.tok_emb, Int8Embedding) else m.tok_emb.weight.dtype)
        dtype = torch.promote_types(dtype, m.pos_emb.weight.dtype)  # the rows' dtype, as the model's sum makes it

        def norm(ln: torch.nn.LayerNorm) -> tuple:
            return ln.normalized_shape, ln.weight, ln.bias, ln.eps

        self.tok_emb, self.pos_table, self.n_head = m.tok_emb.forward, m.pos_emb.weight, m.config.n_head
        self.layers = [(norm(b.ln1), bound_product(b.attn.qkv, B, dtype), self.cache.k[i], self.cache.v[i],
                        b.attn.scale, bound_product(b.attn.proj, B, dtype), norm(b.ln2),
                        bound_product(b.mlp.fc, B, dtype), b.mlp.act, bound_product(b.mlp.proj, B, dtype))
                       for i, b in enumerate(m.blocks)]
        self.final_norm, self.head = norm(m.final_norm), bound_product(m.lm_head, B, dtype)

    @property
    def description(self) -> str:
        attention = "gpt2port's one-token kernel" if self.kernel_attention else "SDPA"
        return f"{'a CUDA graph of ' if self.graph is not None else ''}gpt2port.fast's step (attention: {attention})"

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        if torch.is_grad_enabled() or cache.length >= cache.max_len:  # the model's forward says what is wrong
            return self.model(ids, cache=cache, last_only=True)
        self.sync()
        self.ids.copy_(ids.view(-1, 1))
        if self.graph is not None:
            self.graph.replay()  # the step and the position's advance, recorded
            logits = self.logits.clone()  # the next replay overwrites the graph's output; the caller may keep this
        else:
            logits = self.forward()
            self.pos.add_(1)
        cache.length += 1
        self._pos_at = cache.length
        return logits.view(ids.size(0), 1, -1)

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
        """The step on self.ids at self.pos: what GPT.forward does for one new token per row, in eval mode (where
        dropout is the identity, so it is left out). Rows stay (B, C) throughout; every product, norm and cache view
        was bound once (self.layers); residuals are added in place. PyTorch's lookup of __torch_function__ is off for
        the whole step: every tensor here is a plain one (or a Parameter, whose lookup does nothing), and fbgemm's
        packed weights would otherwise cost a failed lookup each (gpt2port.quant.fbgemm_linear)."""
        with torch._C.DisableTorchFunctionSubclass():
            if self.kernel_attention and self.cache.pad is None:
                return self._one_sequence()
            return self._masked()

    def _one_sequence(self) -> torch.Tensor:
        """One unpadded row on the CPU: the position as a number, no mask, attention on gpt2port's kernel (which
        writes the cache itself)."""
        length, attend, layer_norm = self.cache.length, torch.ops.gpt2port.attend_one, torch.layer_norm
        x = self.tok_emb(self.ids.view(-1)) + self.pos_table[length]
        for ln1, qkv, keys, values, scale, proj, ln2, fc, act, out in self.layers:
            y = attend(qkv(layer_norm(x, *ln1)), keys, values, length, scale)
            x.add_(proj(y))
            x.add_(out(act(fc(layer_norm(x, *ln2)))))
        return self.head(layer_norm(x, *self.final_norm))

    def _masked(self) -> torch.Tensor:
        """Left-padded rows (or no kernel): positions counted from each row's first real token, as GPT.embed, and
        attention on SDPA over every slot of the cache, masked."""
        B, layer_norm, sdpa = self.ids.size(0), torch.layer_norm, F.scaled_dot_product_attention
        x = self.tok_emb(self.ids.view(-1)) + F.embedding((self.pos - self.pad).clamp(min=0), self.pos_table)
        # (B, 1, 1, slots): the slots a row's query sees, up to its own and not its padding (a query's own position
        # is never padding: every row has at least one real token)
        visible = ((self.slots <= self.pos) & (self.slots >= self.pad.view(B, 1))).view(B, 1, 1, -1)
        at = self.pos.view(1)
        for ln1, qkv, keys, values, scale, proj, ln2, fc, act, out in self.layers:
            # (B, 3C) -> q, k, v (B, H, 1, D): with one position no permute is needed to reach SDPA's layout
            q, k, v = qkv(layer_norm(x, *ln1)).view(B, 3, self.n_head, 1, -1).unbind(1)
            keys.index_copy_(2, at, k)
            values.index_copy_(2, at, v)
            y = sdpa(q, keys, values, attn_mask=visible, scale=scale)
            x.add_(proj(y.transpose(1, 2).reshape(B, -1)))
            x.add_(out(act(fc(layer_norm(x, *ln2)))))
        return self.head(layer_norm(x, *self.final_norm))

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


class ModelStep:
    """The model's own forward, one token per call: where the step does not apply, or is switched off."""

    def __init__(self, model: GPT, cache: KVCache, why: str):
        self.model, self.cache, self.description = model, cache, f"the model's forward ({why})"

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, cache=self.cache, last_only=True)


def decode_step(model: GPT, cache: KVCache, settings: Settings) -> Step | ModelStep:
    """The step generation takes for this model and cache: Step where it applies (recorded as a CUDA graph on a CUDA
    device when settings.cuda_graph), else the model's forward. `.description` says which, for `generate -v`."""
    why = applies(model, cache) if settings.step else "switched off"
    if why is not None:
        return ModelStep(model, cache, why)
    step = Step(model, cache, settings)
    if settings.cuda_graph and cache.k.device.type == "cuda":
        try:
            step.capture()
        except Exception as e:  # noqa: BLE001 -- a graph that cannot be recorded only costs speed
            warnings.warn(f"gpt2port: decoding without a CUDA graph ({type(e).__name__}: {e})", stacklevel=2)
            step.graph = None
    return step


def hooked(model: torch.nn.Module) -> bool:
    """Whether any hook would run in the model's own forward."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
