"""Which kernel computes each product, decided in one place (`choose`), and the layers swapped into a model to use
it (`accelerate`).

The kernels, for inference on the CPU (autograd, torch.compile and other devices always get F.linear):
- NATIVE: gpt2port's own one-row product (native.py, matvec.c), fp32 or bf16: a decode step's every product.
- ONEDNN: oneDNN's linear (torch.ops.mkldnn._linear_pointwise, a private op probed before use), fp32: F.linear
  calls MKL, whose fp32 few-row and many-row products here stream the weight well below what oneDNN reaches.
- PLAIN: F.linear.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2port.fast import native
from gpt2port.fast.settings import Settings
from gpt2port.quant import Int8Linear

PLAIN, ONEDNN, NATIVE = "F.linear", "oneDNN", "gpt2port's one-row kernel"


def choose(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, settings: Settings) -> str:
    """The kernel for inference products of `rows` rows by this weight on the CPU: NATIVE for one row where it is
    built and takes the weight, else ONEDNN for fp32 where it works, else PLAIN."""
    if weight.device.type != "cpu":
        return PLAIN
    if rows == 1 and settings.native and native.fits(weight, bias) and native.kernels().matvec:
        return NATIVE
    if settings.onednn and weight.dtype == torch.float32 and onednn_works():
        return ONEDNN
    return PLAIN


def choose_attention(keys: torch.Tensor, settings: Settings) -> bool:
    """Whether attention for one new token over this cache of one sequence's keys (1, H, T, D) runs on gpt2port's
    kernel (attention.c) rather than scaled_dot_product_attention."""
    return settings.native and settings.attend_one and native.attends(keys) and native.kernels().attend_one


def product(kind: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias on the kernel `kind` (choose's answer)."""
    if kind == NATIVE:
        return torch.ops.gpt2port.matvec(x, weight, bias)
    if kind == ONEDNN:
        rows = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.size(-1)).contiguous(), weight, bias, "none", [], "")
        return rows.view(*x.shape[:-1], weight.size(0))
    return F.linear(x, weight, bias)


def bound_product(layer: nn.Module, rows: int, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's inference product for (rows, in_features) inputs of `dtype`, as a callable bound once (a decode
    step calls ~50 of them per token): the kernel the layer's forward would take for such inputs, with forward's
    per-call checks made here instead. A layer this does not know, or whose checks fail, gets its own forward."""
    if isinstance(layer, Int8Linear):
        return layer.bound(rows) if dtype == torch.float32 else layer.forward
    if type(layer) not in (nn.Linear, FastLinear) or layer.weight.dtype != dtype:
        return layer.forward
    weight, bias = layer.weight, layer.bias
    kind = PLAIN
    if type(layer) is FastLinear and (weight.dtype, weight.device) == layer.chosen_for:
        kind = layer.one_row if rows == 1 else layer.rows
    if kind == NATIVE:
        matvec = torch.ops.gpt2port.matvec
        return lambda x: matvec(x, weight, bias)
    if kind == ONEDNN:
        onednn = torch.ops.mkldnn._linear_pointwise
        return lambda x: onednn(x.contiguous(), weight, bias, "none", [], "")
    return lambda x: F.linear(x, weight, bias)


class FastLinear(nn.Linear):
    """nn.Linear whose inference products on the CPU run on choose's kernels (one row, and several rows, each
    chosen once, when the layer is swapped in). Same parameters, same state_dict; autograd, torch.compile, other
    devices and a weight whose dtype or device changed since go through F.linear."""

    settings: Settings
    one_row: str
    rows: str
    chosen_for: tuple

    def choose(self, settings: Settings) -> None:
        self.settings = settings
        self.one_row = choose(self.weight, self.bias, 1, settings)
        self.rows = choose(self.weight, self.bias, 2, settings)
        self.chosen_for = (self.weight.dtype, self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or x.dtype != self.weight.dtype or \
                (self.weight.dtype, x.device) != self.chosen_for:
            return F.linear(x, self.weight, self.bias)
        return product(self.one_row if x.numel() == self.in_features else self.rows, x, self.weight, self.bias)


class FastInt8Linear(Int8Linear):
    """Int8Linear whose many-row products multiply each dequantized block on choose's kernel (oneDNN for fp32)."""

    settings: Settings

    def choose(self, settings: Settings) -> None:
        self.settings = settings

    def dense(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return product(choose(weight, bias, rows.size(0), self.settings), rows, weight, bias)


def accelerate(model: nn.Module, settings: Settings | None = None) -> nn.Module:
    """Swap the model's linear layers for the fast ones, in place, and return it (gpt-fast's pattern). Each layer
    keeps its parameters, buffers and hooks: its class changes, nothing else (so a state_dict, a tied head, an
    optimizer's references are the same). With native kernels asked for, they are built or loaded here (once per
    machine, with a line on stderr). Calling it again re-chooses with the new settings."""
    settings = settings or Settings.from_env()
    for m in model.modules():
        if type(m) in (nn.Linear, FastLinear):
            m.__class__ = FastLinear
        elif type(m) in (Int8Linear, FastInt8Linear):
            m.__class__ = FastInt8Linear
        else:
            continue
        m.choose(settings)
    return model


@contextlib.contextmanager
def accelerated(model: nn.Module, settings: Settings) -> Iterator[nn.Module]:
    """The model with its plain linear layers swapped for fast ones within the block, and back after (layers that
    were fast already keep their own choice)."""
    plain = [m for m in model.modules() if type(m) in (nn.Linear, Int8Linear)]
    for m in plain:
        m.__class__ = FastLinear if type(m) is nn.Linear else FastInt8Linear
        m.choose(settings)
    try:
        yield model
    finally:
        for m in plain:
            m.__class__ = nn.Linear if type(m) is FastLinear else Int8Linear


def restore(model: nn.Module) -> nn.Module:
    """Undo accelerate: every fast layer back to the plain class it was."""
    for m in model.modules():
        if type(m) is FastLinear:
            m.__class__ = nn.Linear
        elif type(m) is FastInt8Linear:
            m.__class__ = Int8Linear
    return model


@functools.cache
def onednn_works() -> bool:
    """Whether this PyTorch has oneDNN's linear kernel (a private op) and it agrees with F.linear, on a probe whose
    data come from a private generator (the global random state is left as it was)."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g) for shape in ((3, 8), (5, 8), (5,)))
    try:
        y = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return torch.allclose(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
