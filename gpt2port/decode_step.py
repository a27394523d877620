"""One decoding step of gpt2port's GPT run by TorchScript instead of Python: the same operations in the same order
(so the same numbers), minus Python's cost per operation.

A decode step multiplies one token by every weight once; at 124M with int8 weights those products take ~5 ms on two
cores, and in eager PyTorch the step's other ~250 operations (embedding, norms, views, cache writes, attention,
residual adds, module calls) cost Python and dispatch time of a few microseconds each, ~1.5 ms more. Here the whole
step, from the token ids to the logits, is one TorchScript module that holds the model's weights in lists and calls
the same kernels the model's own layers call (gpt2port's one-row product, fbgemm's int8 product, oneDNN's fp32
linear, F.linear otherwise; gpt2port's one-token attention or SDPA).
Scripting it takes a few milliseconds; a model keeps its latest step for its next generation (_SCRIPTED).

`stepper(model, cache)` returns the scripted step only for a model it can reproduce exactly: a GPT (not a subclass)
in eval mode on the CPU, built of the model's own embedding, block, norm and linear classes, with no hooks anywhere,
and every matrix on one kernel. On a CUDA device it returns the step recorded as a CUDA graph instead
(gpt2port/cuda_graph.py), for a GPT of the model's own blocks and attention with no hooks. Anything else (a modified
model, training, TorchScript or the graph's recording missing or failing) gets the model's own forward: the step is
a speed-up, never a second behaviour. This is checked when the step is built, at the start of each generation: a
hook added while one is under way is seen from the next. tests/test_decode_step.py holds the two to equal logits for
every kernel, activation, batch and padding the step accepts; tests/test_cuda_graph.py does the same for the graph.
"""

# No `from __future__ import annotations` here: TorchScript reads _Step's attribute annotations as types, not strings.
import warnings
import weakref
from collections.abc import Callable
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2port import cuda_graph, kernels, native
from gpt2port.model import GPT, MLP, Block, CausalSelfAttention, KVCache

# Take the scripted step where it applies; a switch for comparisons and debugging (False: always the model's forward).
SCRIPTED = True
# How the steps of the latest generation ran, for `generate --verbose`: "TorchScript (products: <kernel>; attention:
# <kernel>)", "a CUDA graph" or "the model's forward" (set by stepper; a user asking why decoding is slow sees whether
# a fast step was taken, and on which kernels).
last_path: str | None = None
# The kernels the blocks' products run on, as the model's own Linear layers would choose them (NATIVE: one row of
# fp32 or bf16 on gpt2port's own kernel, gpt2port/native.py), and how `generate --verbose` names them.
PLAIN, ONEDNN, FBGEMM, NATIVE = "plain", "onednn", "fbgemm", "native"
_KERNEL_NAMES = {PLAIN: "F.linear", ONEDNN: "oneDNN", FBGEMM: "fbgemm", NATIVE: "gpt2port's one-row kernel"}
# The model's activation functions (gpt2port.kernels.ACTIVATIONS' values) by the name the script knows them by.
_ACTIVATIONS = {kernels._gelu_tanh: "gelu_tanh", F.gelu: "gelu", F.relu: "relu", F.silu: "silu"}


class _Step(nn.Module):
    """The whole model for one new token per row: idx (B, 1) -> logits (B, vocab), writing each layer's k, v at
    `length`. What GPT.forward does for T=1 in eval mode: the token's row plus its position's row, then per block
    x + proj(attention(ln1(x))), then + mlp(ln2(x)), then the final norm and the head. Products are held in order
    (per block qkv, attention proj, fc, mlp proj; the head last), norms as (weight, bias) pairs in the same order.
    """

    packed: List[torch.classes.quantized.LinearPackedParamsBase]
    in_scales: List[Optional[torch.Tensor]]
    weights: List[torch.Tensor]
    biases: List[Optional[torch.Tensor]]
    norms: List[torch.Tensor]
    scale: Optional[float]
    tok_scale: Optional[torch.Tensor]

    def __init__(self, model: GPT, kind: str, packed: list, reduce_range: bool, attend_one: bool):
        super().__init__()
        # attention for one token of one unpadded sequence on gpt2port's kernel, where the model's would take it
        self.attend_one = attend_one
        config, linears = model.config, _linears(model)
        self.kind, self.packed, self.reduce_range = kind, packed, reduce_range
        # int8 products smoothed against outlier channels divide their inputs first (gpt2port.quant: in_scale)
        self.in_scales = [m.in_scale for m in linears] if kind == FBGEMM else []
        self.weights = [] if kind == FBGEMM else [m.weight for m in linears]
        self.biases = [] if kind == FBGEMM else [m.bias for m in linears]
        norms = [ln for b in model.blocks for ln in (b.ln1, b.ln2)] + [model.final_norm]
        self.norms = [t for ln in norms for t in (ln.weight, ln.bias)]
        self.n_layer, self.n_head, self.head_dim = len(model.blocks), config.n_head, config.head_dim
        self.eps = float(config.layer_norm_epsilon)
        self.scale = model.blocks[0].attn.scale
        self.act = _ACTIVATIONS[model.blocks[0].mlp.act]
        # The token table: an int8 model's is the head's int8 matrix, each row scaled back on lookup.
        table = getattr(model.tok_emb, "table", None)
        self.tok = model.tok_emb.weight if table is None else table.weight
        self.tok_scale = None if table is None else table.scale
        self.pos = model.pos_emb.weight

    def linear(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if self.kind == "fbgemm":
            in_scale = self.in_scales[i]
            if in_scale is not None:
                x = x * in_scale
            return torch.ops.quantized.linear_dynamic(x, self.packed[i], self.reduce_range)
        if self.kind == "native":
            return torch.ops.gpt2port.matvec(x, self.weights[i], self.biases[i])
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weights[i], self.biases[i], "none", [], "")
        return F.linear(x, self.weights[i], self.biases[i])

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        if self.act == "gelu_tanh":
            return F.gelu(x, approximate="tanh")
        if self.act == "gelu":
            return F.gelu(x)
        if self.act == "relu":
            return F.relu(x)
        return F.silu(x)

    def norm(self, x: torch.Tensor, i: int) -> torch.Tensor:
        return F.layer_norm(x, [x.size(1)], self.norms[2 * i], self.norms[2 * i + 1], self.eps)

    def embed(self, idx: torch.Tensor, length: int, pad: Optional[torch.Tensor]) -> torch.Tensor:
        rows = idx.view(-1)
        x = F.embedding(rows, self.tok)
        tok_scale = self.tok_scale
        if tok_scale is not None:
            x = x.float() * tok_scale[rows].unsqueeze(-1)
        if pad is None:
            return x + self.pos[length]
        # left-padded rows count positions from their first real token (padding gets 0), as GPT.embed
        return x + F.embedding((length - pad).clamp(min=0), self.pos)

    def forward(self, idx: torch.Tensor, length: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                mask: Optional[torch.Tensor], pad: Optional[torch.Tensor]) -> torch.Tensor:
        x = self.embed(idx, length, pad)
        B, C = x.size(0), x.size(1)
        for layer in range(self.n_layer):
            qkv = self.linear(self.norm(x, 2 * layer), 4 * layer)
            if self.attend_one and mask is None and qkv.dtype == k_cache.dtype:  # as the model's attention chooses
                y = torch.ops.gpt2port.attend_one(qkv, k_cache[layer], v_cache[layer], length, self.scale)
            else:
                # (B, 3C) -> q, k, v (B, H, 1, D): with one position, no permute is needed to reach SDPA's layout
                q, k, v = qkv.view(B, 3, self.n_head, 1, self.head_dim).unbind(1)
                keys, values = k_cache[layer], v_cache[layer]
                keys.narrow(2, length, 1).copy_(k)
                values.narrow(2, length, 1).copy_(v)
                y = F.scaled_dot_product_attention(q, keys.narrow(2, 0, length + 1),
                                                   values.narrow(2, 0, length + 1), attn_mask=mask, scale=self.scale)
                y = y.transpose(1, 2).reshape(B, C)
            x = x + self.linear(y, 4 * layer + 1)
            h = self.activation(self.linear(self.norm(x, 2 * layer + 1), 4 * layer + 2))
            x = x + self.linear(h, 4 * layer + 3)
        return self.linear(self.norm(x, 2 * self.n_layer), 4 * self.n_layer)


def stepper(model: GPT, cache: KVCache) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function idx (B, 1) -> logits (B, 1, vocab) doing what model(idx, cache=cache, last_only=True) does: on the
    CPU the scripted step, on a CUDA device a recorded CUDA graph (gpt2port/cuda_graph.py), where the model is one
    they reproduce exactly (see the module's docstring); else that call."""
    global last_path
    if cache.k.device.type == "cuda":
        fast, last_path = _graphed_step(model, cache), "a CUDA graph"
    else:
        kind, attend_one = _kind(model, cache), kernels.attention_kernel_takes(cache)
        attention = "gpt2port's one-token kernel" if attend_one else "SDPA"
        fast, last_path = _scripted_call(model, cache, kind, attend_one), \
            f"TorchScript (products: {_KERNEL_NAMES.get(kind, kind)}; attention: {attention})"
    if fast is None:
        last_path = "the model's forward"
        return lambda idx: model(idx, cache=cache, last_only=True)
    n_positions = model.config.n_positions

    def step(idx: torch.Tensor) -> torch.Tensor:
        # The model's Linear picks another kernel under autograd; past the context the model says what is wrong.
        if torch.is_grad_enabled() or cache.length >= n_positions:
            return model(idx, cache=cache, last_only=True)
        logits = fast(idx)
        cache.length += 1
        return logits.view(idx.size(0), 1, -1)

    return step


def _scripted_call(model: GPT, cache: KVCache, kind: str | None, attend_one: bool
                   ) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """idx (B, 1) -> logits (B, vocab) through the scripted step on the products' kernel `kind` (_kind's answer),
    writing the cache at cache.length; None where the step does not apply."""
    scripted = _scripted_step(model, kind, attend_one) if SCRIPTED else None
    if scripted is None:
        return None

    def call(idx: torch.Tensor) -> torch.Tensor:
        mask, _ = cache.attn_mask(1, idx.device)
        with torch.jit.optimized_execution(False):  # no profiling runs: each step's key count is a new shape
            return scripted(idx, cache.length, cache.k, cache.v, mask, cache.pad)

    return call


def _graphed_step(model: GPT, cache: KVCache) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The recorded step for a model whose blocks cuda_graph.StaticStep writes out exactly as the model computes
    them: a GPT (not a subclass) in eval mode, of the model's own Block and attention, with no hooks (a graph replays
    kernels, never Python: a hook would run once, while recording). Its embeddings, norms, products and MLPs are the
    model's own modules, called as they are."""
    if type(model) is not GPT or any(m.training for m in model.modules()) or hooked(model) or \
            any(type(b) is not Block or type(b.attn) is not CausalSelfAttention for b in model.blocks):
        return None
    return cuda_graph.graphed_step(model, cache)


def _scripted_step(model: GPT, kind: str | None, attend_one: bool) -> torch.jit.ScriptModule | None:
    if kind is None:
        return None
    packed, reduce_range = [], False
    if kind == FBGEMM:
        from gpt2port import quant

        packed = [m._packed for m in _linears(model)]
        reduce_range = quant._reduce_range()
    step = _Step(model, kind, packed, reduce_range, attend_one)
    key = _identity(step)
    cached = _SCRIPTED.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    try:
        with warnings.catch_warnings():  # PyTorch marks TorchScript deprecated; where it is gone, the plain forward
            warnings.simplefilter("ignore")
            scripted = torch.jit.script(step)
    except Exception:  # noqa: BLE001 -- failing to script only costs speed
        return None
    _SCRIPTED[model] = (key, scripted)
    return scripted


# The latest scripted step of each model, with what it was built from: scripting takes ~7 ms and its first run ~5 ms
# more, ~1% of a 124M model's 128-token generation, so a model generating again reuses its step while the step would
# be built the same. The step holds the model's tensors themselves, so weights changed in place are seen; a tensor
# replaced (load_state_dict(assign=True), .to(), .data =), a kernel switched, a setting changed builds a new one.
_SCRIPTED: "weakref.WeakKeyDictionary[GPT, tuple]" = weakref.WeakKeyDictionary()


def _identity(step: _Step) -> tuple:
    """What a scripted step is built from: every tensor it holds (which one, where its numbers are, their dtype and
    shape), int8's packed matrices, and its settings."""
    tensors = [*step.weights, *step.biases, *step.norms, *step.in_scales, step.tok, step.tok_scale, step.pos]
    return (tuple(None if t is None else (id(t), t.data_ptr(), t.dtype, tuple(t.shape)) for t in tensors),
            tuple(id(p) for p in step.packed), step.kind, step.reduce_range, step.attend_one, step.n_layer,
            step.n_head, step.head_dim, step.eps, step.scale, step.act)


def _kind(model: GPT, cache: KVCache) -> str | None:
    """The kernel every product of the model runs on, or None where the scripted step would not be the model."""
    if type(model) is not GPT or any(m.training for m in model.modules()) or cache.k.device.type != "cpu" or \
            not model.blocks or model.blocks[0].mlp.act not in _ACTIVATIONS or hooked(model):
        return None
    parts = [(model.pos_emb, nn.Embedding), (model.drop, nn.Dropout), (model.final_norm, nn.LayerNorm)]
    for block in model.blocks:
        parts += [(block, Block), (block.attn, CausalSelfAttention), (block.mlp, MLP), (block.ln1, nn.LayerNorm),
                  (block.ln2, nn.LayerNorm), (block.attn.resid_dropout, nn.Dropout), (block.mlp.dropout, nn.Dropout)]
    norms = [m for m, cls in parts if cls is nn.LayerNorm]
    if any(type(m) is not cls for m, cls in parts) or model.pos_emb.max_norm is not None or \
            any(ln.weight is None or ln.bias is None or ln.eps != model.config.layer_norm_epsilon for ln in norms):
        return None
    linears = _linears(model)
    if all(type(m) is kernels.Linear for m in linears):
        if type(model.tok_emb) is not nn.Embedding or model.tok_emb.max_norm is not None:
            return None
        dtypes = {m.weight.dtype for m in linears} | {cache.k.dtype, model.tok_emb.weight.dtype,
                                                        model.pos_emb.weight.dtype}
        if len(dtypes) != 1:
            return None
        # One row per step (a batch of one) is what gpt2port's kernel takes (fp32, bf16), as in the model's Linear
        if cache.k.size(1) == 1 and all(native.takes(m.weight, m.bias) for m in linears):
            return NATIVE
        if dtypes != {torch.float32}:
            return PLAIN
        return ONEDNN if kernels.onednn_linear_enabled() else PLAIN
    from gpt2port.quant import Int8Embedding, Int8Linear

    # Int8Linear runs one row on fbgemm and several on another kernel (see gpt2port.quant): one row only here.
    if cache.k.size(1) == 1 and type(model.tok_emb) is Int8Embedding and model.pos_emb.weight.dtype == torch.float32 \
            and all(type(m) is Int8Linear and m._packed is not None for m in linears):
        return FBGEMM
    return None


def _linears(model: GPT) -> list[nn.Module]:
    """The model's matrices in the order _Step indexes them: per block qkv, attention proj, fc, mlp proj; the head."""
    return [m for b in model.blocks for m in (b.attn.qkv, b.attn.proj, b.mlp.fc, b.mlp.proj)] + [model.lm_head]


def hooked(model: nn.Module) -> bool:
    """Whether any hook would run in the model's own forward (a scripted or recorded step would skip it)."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
