"""The compute pieces gpt2port.model opts into: its activation functions, a Linear layer whose fp32 inference on CPU
runs on oneDNN, or on gpt2port's own kernel for one row, and when attention for one new token runs on gpt2port's
own kernel. The model's structure lives in model.py; how its products are computed lives here."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2port import native


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# Activations the model implements, by their HF `activation_function` name; config.py accepts exactly these names.
# GPT-2's own is the tanh approximation ("gelu_new"): exact-erf GELU differs by up to ~1e-3 and breaks logit parity.
# The others appear in fine-tuned or re-implemented checkpoints.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}

# Route inference-time fp32 products on CPU through oneDNN (see Linear); a switch for comparisons and debugging.
USE_ONEDNN = True
# Attention for one new token on gpt2port's kernel where it applies (see attends_one); likewise a switch.
ATTEND_ONE = True


class Linear(nn.Linear):
    """nn.Linear whose fp32 inference on CPU runs on oneDNN's linear kernel: same parameters, same fp32 math.

    F.linear calls MKL, whose fp32 matrix-vector and few-row products stream the weight well below what memory
    gives on the CPUs measured, while oneDNN (PyTorch's other CPU library, the one torch.compile puts under linear
    layers) comes much closer. One decoding step is nothing but such products, so generation and prefill get
    markedly faster (scripts/bench_generate.py compares both paths; the README has the figures). One row alone (a
    decode step's every product), fp32 or bf16, goes to gpt2port's own kernel where it is built
    (gpt2port/native.py), which streams the weight faster still. Autograd, other devices and dtypes, and PyTorch
    builds without the kernels go through F.linear as usual.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch.compile picks kernels of its own (and cannot trace oneDNN's op on a plain weight)
        if torch.is_grad_enabled() or x.device.type != "cpu" or torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        if native.applies(x, self.weight, self.bias):  # one row, fp32 or bf16: gpt2port's own kernel (native.py)
            return torch.ops.gpt2port.matvec(x, self.weight, self.bias)  # x's shape, (1, ..., out_features)
        if not onednn_takes(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        return _onednn(x.reshape(-1, self.in_features), self.weight, self.bias).view(*x.shape[:-1], self.out_features)


def onednn_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product of x by weight goes to oneDNN (see Linear): fp32 inference on the CPU, not compiling, the
    kernel switched on and working."""
    return not torch.is_grad_enabled() and x.device.type == "cpu" and not torch.compiler.is_compiling() and \
        x.dtype == torch.float32 and weight.dtype == torch.float32 and onednn_linear_enabled()


def fp32_product(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows (N, in) @ weight.T + bias on oneDNN where it takes them (onednn_takes), else on F.linear."""
    return _onednn(rows, weight, bias) if onednn_takes(rows, weight) else F.linear(rows, weight, bias)


def _onednn(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), weight, bias, "none", [], "")


def attends_one(qkv: torch.Tensor, cache) -> bool:
    """Whether attention runs on gpt2port's kernel for one new token (torch.ops.gpt2port.attend_one, attention.c:
    a few times fewer microseconds than scaled_dot_product_attention with the cache writes and reshapes around it):
    one new token of one unpadded sequence, of the cache's dtype, in inference outside torch.compile, over a cache
    the kernel takes. Elsewhere attention is PyTorch's."""
    return qkv.shape[:-1].numel() == 1 and qkv.dtype == cache.k.dtype and not torch.is_grad_enabled() and \
        not torch.compiler.is_compiling() and attention_kernel_takes(cache)


def attention_kernel_takes(cache) -> bool:
    """Whether gpt2port's one-token attention kernel takes this cache: one unpadded sequence, fp32 or bf16 on the
    CPU (gpt2port.native.attends), and the kernel switched on."""
    return ATTEND_ONE and cache.pad is None and native.attends(cache.k[0])  # attends(): one sequence


@functools.cache
def _onednn_linear_works() -> bool:
    """Whether this PyTorch has oneDNN's linear kernel (a private op) and it agrees with F.linear.

    The probe runs on first use, inside a user's forward: its data come from a private generator, so the global
    random state, and with it whatever the user seeded, is left as it was.
    """
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g) for shape in ((3, 8), (5, 8), (5,)))
    try:
        y = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return torch.allclose(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def onednn_linear_enabled() -> bool:
    """Whether Linear takes the oneDNN path now: switched on, available in this build, and probed correct."""
    return USE_ONEDNN and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled and \
        _onednn_linear_works()
