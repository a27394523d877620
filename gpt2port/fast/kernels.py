"""Which kernel computes each product, decided in one place (`choose`), and the layers swapped into a model to use
it (`accelerate`), with the small layers of a decode step on gpt2port's kernels (layers.c: LayerNorm, the MLP's tanh
GELU) where they are built.

The kernels, for inference on the CPU (autograd, torch.compile and other devices always get F.linear):
- NATIVE: gpt2port's own one-row product (native.py, matvec.c), fp32 or bf16: a decode step's every product.
- ONEDNN: oneDNN's linear (torch.ops.mkldnn._linear_pointwise, a private op probed before use), fp32: F.linear
  calls MKL, whose fp32 few-row and many-row products here stream the weight well below what oneDNN reaches.
- LINEAR: F.linear.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2port.activations import TABLE
from gpt2port.fast import native
from gpt2port.fast.settings import Settings
from gpt2port.quant import Int8Linear
from gpt2port.quant4 import Int4Linear

LINEAR, ONEDNN, NATIVE = "F.linear", "oneDNN", "gpt2port's one-row kernel"


def choose(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, settings: Settings) -> str:
    """The kernel for inference products of `rows` rows by this weight on the CPU: NATIVE for one row where it is
    built and takes the weight, else ONEDNN for fp32 where it works, else LINEAR."""
    if weight.device.type != "cpu":
        return LINEAR
    if rows == 1 and settings.native and native.fits(weight, bias) and native.kernels().matvec:
        return NATIVE
    if settings.onednn and weight.dtype == torch.float32 and onednn_works():
        return ONEDNN
    return LINEAR


def product(kind: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias on the kernel `kind` (choose's answer)."""
    if kind == NATIVE:
        return torch.ops.gpt2port.matvec(x, weight, bias)
    if kind == ONEDNN:
        rows = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.size(-1)).contiguous(), weight, bias, "none", [], "")
        return rows.view(*x.shape[:-1], weight.size(0))
    return F.linear(x, weight, bias)


@functools.cache
def _entry(name: str):
    """torch.ops.gpt2port.<name>'s default overload by its C++ entry: a decode step makes ~100 such calls, and the
    overload's Python __call__ is a frame more each."""
    op = getattr(torch.ops.gpt2port, name).default
    return getattr(op, "_op", op)


class FastLinear(nn.Linear):
    """nn.Linear whose inference products on the CPU run on choose's kernels (one row, and several rows, each
    chosen once, when the layer is made). The same Parameters as the layer it replaces, so the same state_dict;
    autograd, torch.compile, other devices and a weight whose dtype or device changed since go through F.linear."""

    @classmethod
    def of(cls, layer: nn.Linear, settings: Settings | None = None) -> nn.Linear:
        """A layer of this class (with settings; nn.Linear itself without) over `layer`'s own Parameters."""
        kind = cls if settings is not None else nn.Linear
        new = kind.__new__(kind)
        nn.Module.__init__(new)  # not nn.Linear's: that would make new Parameters
        new.in_features, new.out_features = layer.in_features, layer.out_features
        new.weight = layer.weight
        new.register_parameter("bias", layer.bias)  # None too, as nn.Linear does: forward reads it from _parameters
        new.train(layer.training)
        if settings is not None:
            new.settings = settings
            new.one_row = choose(new.weight, new.bias, 1, settings)
            new.rows = choose(new.weight, new.bias, 2, settings)
            new.chosen_for = (new.weight.dtype, new.weight.device)
            # the one-row kernel looked up once, not per call
            new.matvec = _entry("matvec") if new.one_row == NATIVE else None
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = self._parameters  # read, not through nn.Module.__getattr__: a Python call less per name
        weight, bias = params["weight"], params["bias"]
        dtype, device = self.chosen_for
        if torch.is_grad_enabled() or x.dtype is not dtype or weight.dtype is not dtype or x.device != device:
            return F.linear(x, weight, bias)
        if x.numel() == self.in_features:
            if not torch.compiler.is_compiling() and self.matvec is not None:
                return self.matvec(x, weight, bias)
            kind = self.one_row
        else:
            kind = self.rows
        if kind == ONEDNN and torch.compiler.is_compiling():  # a private op the compiler cannot trace
            return F.linear(x, weight, bias)
        return product(kind, x, weight, bias)


class FastInt8Linear(Int8Linear):
    """Int8Linear whose many-row products multiply each dequantized block on choose's kernel (oneDNN for fp32)."""

    settings: Settings

    def dense(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return product(choose(weight, bias, rows.size(0), self.settings), rows, weight, bias)


class FastInt4Linear(Int4Linear):
    """Int4Linear whose one-row product calls the operator's C++ entry (a decode step makes ~50: the overload's Python
    __call__ is a frame more each), and whose dequantized blocks multiply on choose's kernel (oneDNN for fp32)."""

    settings: Settings

    @classmethod
    def of(cls, layer: Int4Linear, settings: Settings | None = None) -> Int4Linear:
        new = super().of(layer)
        new.settings = settings or Settings()
        new.op = _entry("matvec_int4")
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fp32 row of whole groups (GPT-2's every width): straight to the kernel, the tensors read from the
        # module's dicts (nn.Module.__getattr__ is a Python call per name)
        if x.dtype is torch.float32 and x.numel() == self.padded == self.in_features and \
                not torch.compiler.is_compiling():
            return self.op(x, self._buffers["weight"], self._parameters.get("bias"), self.padded)
        return super().forward(x)

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return super().matvec(x)
        return self.op(x, self.weight, self.bias, self.padded)

    def dense(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return product(choose(weight, bias, rows.size(0), self.settings), rows, weight, bias)


class FastDropout(nn.Dropout):
    """nn.Dropout that, out of training, returns its input as it is, as F.dropout does, without calling it: a decode
    step passes ~40 of these."""

    @classmethod
    def of(cls, layer: nn.Dropout, fast: bool = True) -> nn.Dropout:
        """A layer of this class (nn.Dropout itself where not fast) with `layer`'s settings."""
        new = (cls if fast else nn.Dropout)(layer.p, layer.inplace)
        return new.train(layer.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if self.training else x


def _one_row(x: torch.Tensor) -> bool:
    """Whether x is one fp32 row on the CPU in inference (a decode step's): what layers.c's kernels are used for.
    Prefill's many rows keep PyTorch's kernels, which spread them over the threads."""
    return x.dtype is torch.float32 and x.device.type == "cpu" and x.numel() == x.size(-1) and \
        not torch.is_grad_enabled() and not torch.compiler.is_compiling()


class FastLayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose one-row fp32 inference on the CPU runs on gpt2port's kernel (layers.c); everything else
    (many rows, other dtypes and devices, autograd, torch.compile) through nn.LayerNorm's forward. The same Parameters
    as the layer it replaces."""

    @classmethod
    def of(cls, layer: nn.LayerNorm, fast: bool = True) -> nn.LayerNorm:
        """A layer of this class (nn.LayerNorm itself where not fast) over `layer`'s own Parameters."""
        kind = cls if fast else nn.LayerNorm
        new = kind.__new__(kind)
        nn.Module.__init__(new)
        new.normalized_shape, new.eps, new.elementwise_affine = layer.normalized_shape, layer.eps, \
            layer.elementwise_affine
        new.register_parameter("weight", layer.weight)
        new.register_parameter("bias", layer.bias)
        return new.train(layer.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = self._parameters
        weight, bias = params["weight"], params["bias"]
        if _one_row(x) and len(self.normalized_shape) == 1 and (weight is None or weight.dtype is torch.float32) and \
                (bias is None or bias.dtype is torch.float32) and x.size(-1) == self.normalized_shape[0]:
            return _entry("layer_norm")(x, weight, bias, self.eps)
        return super().forward(x)


GPT2_GELU = TABLE["gelu_new"].fn  # what model.py's MLP computes for GPT-2's activation


def fast_gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU, on gpt2port's kernel for one fp32 row on the CPU in inference, else as the model computes
    it: what accelerate sets where a module holds GPT2_GELU (an MLP's activation)."""
    return _entry("gelu_tanh")(x) if _one_row(x) else GPT2_GELU(x)


def _layers_built(settings: Settings) -> bool:
    """Whether layers.c's operators may be used: native kernels asked for, and their C++ operators built."""
    return settings.native and native.kernels().attend_one


@functools.cache
def _gelu_agrees() -> bool:
    """Whether layers.c's GELU computes what GPT2_GELU, as activations.py now has it, does: over pre-activations
    from -12 to 12 (an edited formula is then left to run as it is)."""
    x = torch.linspace(-12, 12, 4801)
    with torch.no_grad():
        return torch.allclose(_entry("gelu_tanh")(x), GPT2_GELU(x), rtol=1e-5, atol=1e-6)


def _fast_gelu(settings: Settings) -> bool:
    return _layers_built(settings) and _gelu_agrees()


def _fast(layer: nn.Module, settings: Settings) -> nn.Module:
    if type(layer) is nn.Dropout:
        return FastDropout.of(layer)
    if type(layer) is nn.LayerNorm:
        return FastLayerNorm.of(layer, _layers_built(settings))
    if type(layer) is nn.Linear:
        return FastLinear.of(layer, settings)
    if type(layer) is Int4Linear:
        return FastInt4Linear.of(layer, settings)
    fast = FastInt8Linear.of(layer)
    fast.settings = settings
    return fast


def _plain(layer: nn.Module) -> nn.Module:
    """The plain layer computing what `layer` does, over its tensors (the layer itself if it is plain)."""
    if type(layer) is FastLinear:
        return FastLinear.of(layer)
    if type(layer) is FastDropout:
        return FastDropout.of(layer, fast=False)
    if type(layer) is FastLayerNorm:
        return FastLayerNorm.of(layer, fast=False)
    if type(layer) is FastInt4Linear:
        return Int4Linear.of(layer)
    return Int8Linear.of(layer) if type(layer) is FastInt8Linear else layer


# Exact types only: a user's subclass (whose forward may compute something else) keeps its own.
PLAIN_LAYERS = (nn.Linear, Int8Linear, Int4Linear, nn.Dropout, nn.LayerNorm)
FAST_LAYERS = (FastLinear, FastInt8Linear, FastInt4Linear, FastDropout, FastLayerNorm)


def _swappable(model: nn.Module, kinds: tuple = PLAIN_LAYERS + FAST_LAYERS) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, layer) for every layer of one of `kinds` without hooks (a replacement would drop them:
    a hooked layer keeps its own forward)."""
    return [(parent, name, layer) for parent in model.modules() for name, layer in parent.named_children()
            if type(layer) in kinds and not (layer._forward_hooks or layer._forward_pre_hooks)]


def _holding(model: nn.Module, fn) -> list[tuple[nn.Module, str]]:
    """(module, attribute) for every attribute of the model's modules that is the function `fn` itself (an
    activation is a function, where layers are modules): by identity, so a user's own function, even one computing
    the same, is left alone."""
    return [(m, name) for m in model.modules() for name, value in vars(m).items() if value is fn]


def accelerate(model: nn.Module, settings: Settings | None = None) -> nn.Module:
    """Replace the model's linear layers (exactly nn.Linear, Int8Linear or Int4Linear, without hooks) by fast ones
    computing the same product on choose's kernels, its dropouts (exactly nn.Dropout) by FastDropout and its
    LayerNorms (exactly nn.LayerNorm) by FastLayerNorm, in place, and return it; an attribute holding GPT-2's tanh
    GELU as model.py computes it (an MLP's activation) gets fast_gelu_tanh. Each new layer holds the old one's
    Parameters and buffers (so a state_dict, a tied head, an optimizer's references are the same); it is set where
    the old one was, as a submodule (a layer given alone is returned replaced). With native kernels asked for, they
    are built or loaded here (once per machine, with a line on stderr). Calling it again re-chooses with the new
    settings."""
    settings = settings or Settings.from_env()
    if type(model) in PLAIN_LAYERS + FAST_LAYERS:  # a layer alone: its replacement is returned
        return _fast(_plain(model), settings)
    for parent, name, layer in _swappable(model):
        setattr(parent, name, _fast(_plain(layer), settings))
    fast = _fast_gelu(settings)
    for module, name in _holding(model, GPT2_GELU if fast else fast_gelu_tanh):
        setattr(module, name, fast_gelu_tanh if fast else GPT2_GELU)
    return model


@contextlib.contextmanager
def accelerated(model: nn.Module, settings: Settings) -> Iterator[nn.Module]:
    """The model with its plain layers replaced by fast ones within the block, and the very same layers (and
    activations) put back after (layers that were fast already keep their own choice)."""
    plain = _swappable(model, PLAIN_LAYERS)
    for parent, name, layer in plain:
        setattr(parent, name, _fast(layer, settings))
    gelus = _holding(model, GPT2_GELU) if _fast_gelu(settings) else []
    for module, name in gelus:
        setattr(module, name, fast_gelu_tanh)
    try:
        yield model
    finally:
        for parent, name, layer in plain:
            setattr(parent, name, layer)
        for module, name in gelus:
            setattr(module, name, GPT2_GELU)


def restore(model: nn.Module) -> nn.Module:
    """Undo accelerate: every fast layer replaced by a plain one holding its Parameters, and GPT-2's GELU as the
    model computes it put back."""
    if type(model) in FAST_LAYERS:
        return _plain(model)
    for parent, name, layer in _swappable(model, FAST_LAYERS):
        setattr(parent, name, _plain(layer))
    for module, name in _holding(model, fast_gelu_tanh):
        setattr(module, name, GPT2_GELU)
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
