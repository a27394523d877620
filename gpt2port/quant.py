"""int8 weight-only inference: GPT.from_pretrained(path, dtype="int8") and `generate --dtype int8`.

Every matrix of the model (the four per block, and the token embedding, which is also the tied head) is stored as
int8 with one fp32 scale per output row: w ~= q * scale, scale = max|row| / 127, q = round(w / scale). Symmetric,
per output channel, so the head's rows and the embedding's rows are the same rows with the same scales: the tied
matrix is stored once. Norms, biases and the position table stay fp32 (they are small, and they set the scale
of everything downstream).

How the products run, by the number of rows (tokens) they multiply:
- one row (a decode step): PyTorch's fbgemm int8 kernel (`torch.ops.quantized.linear_dynamic`), which quantizes the
  row of activations to int8 on the fly (one scale for the row) and takes int8 dot products against a packed copy of
  the weight: a step streams a quarter of the fp32 bytes, with int8 arithmetic (about twice the bandwidth int8pack
  below reaches on one row here). The packed copy doubles the int8 memory: half of fp32 in all.
- a few rows (a short prompt's prefill), or one row where fbgemm is missing: PyTorch's int8 weight-packed kernel
  (`torch._weight_int8pack_mm`) with bf16 activations, each row in its own precision.
- more rows (a long prompt, verify's inputs): the weight dequantized to fp32 a block of output rows at a time, each
  block multiplied while it is in cache (on F.linear; gpt2port.fast.accelerate puts oneDNN there, as for an fp32
  model's products, scripts/bench/prefill.py): fp32's numbers at fp32's speed
  (a GEMM over many rows is bound by arithmetic, not by reading the weight), without writing out and faulting in a
  whole fp32 copy of each matrix (that took 4.3 s of a 17-token prefill at 1.5B, 1.0 s in blocks).

fbgemm's one scale per row of activations is what outlier channels hurt: where a few input channels run tens of
times larger than the rest (LayerNorm gains, MLP units; trained models have them, random weights do not), the scale
is set by them and the other channels keep three or four bits. So quantizing also runs the fp32 model, block by
block as its matrices are read, over CALIBRATION_TOKENS tokens, and wherever a product's inputs have such channels
(the largest channel OUTLIER_RATIO times the median one or more) it is smoothed: in fbgemm's packed copy the weight's
columns are multiplied by s_j = max|x_j|^a / max|w_j|^(1-a) before rounding and its inputs divided by s_j on the way
in (one product by a vector), which leaves the product unchanged and moves the outliers' range into the weight,
where every row has its own scale. That trades the weight's precision for the activations': a is chosen per product
by running fbgemm itself on the calibration's inputs against a sample of the weight's rows, smoothed with each a and
not at all, keeping what strays least from fp32 (outliers in a few tokens only can make smoothing the worse choice);
and s never enlarges a channel's inputs beyond the median channel's factor (a channel quiet in calibration may not
be quiet later). The int8 weight the other kernels use stays as it is. Elsewhere nothing changes.

Quantization happens at load, from the checkpoint's tensors in whatever dtype they are stored, a block's matrices at a
time: peak memory is the int8 model plus one block's matrices in fp32, never the fp32 model. Once loaded, the memory
that holds the int8 matrices and fbgemm's packed copies is moved into 2 MB pages where Linux allows (huge_pages): a
decode step reads it all, and with 4 KB pages it also walks page tables for most of it.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2port.errors import GPT2PortError

INT8 = "int8"
# The fallback kernel's activations: bf16, the 16-bit type x86 CPUs compute natively (its fp16 path: >10x slower).
ACTIVATION_DTYPE = torch.bfloat16
# Up to this many rows, int8pack beats dequantizing the weight for one fp32 product (its cost grows with the rows).
FEW_ROWS = 16
# Output rows dequantized per block for many-row products: at 1024, a block of the widest GPT-2 matrix (6400 inputs)
# is 26 MB of fp32; smaller blocks were slower on 1.5B's matrices (64 rows: up to 1.4x, 256: up to 1.2x).
BLOCK_ROWS = 1024
# Smoothing (see the module's docstring): tokens of the calibration run; the ratio of the largest input channel's
# maximum to the median channel's from which a product is considered (random 124M and 1.5B weights: 2-9; three
# LayerNorm gains and four MLP units per block scaled 10x: 20-40, 30x: 30-70); the exponents a tried, each against
# not smoothing, on SEARCH_ROWS of the weight's rows.
CALIBRATION_TOKENS = 32
OUTLIER_RATIO = 12.0
SMOOTHING_ALPHAS = (0.25, 0.5, 0.75)
SEARCH_ROWS = 256


def quantize_rows(w: torch.Tensor, chunk: int = 4096, columns: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 (N, K), scale fp32 (N,)) with w * columns ~= q * scale[:, None] (columns: a factor per input channel,
    or none); an all-zero row gets scale 1 (q is 0). Rows go `chunk` at a time, so the fp32 temporaries stay small
    whatever the matrix (the head has 50k rows)."""
    q = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(w.size(0), dtype=torch.float32)
    for start in range(0, w.size(0), chunk):
        rows = w[start : start + chunk].float()
        if columns is not None:
            rows = rows * columns
        s = rows.abs().amax(dim=1) / 127.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        q[start : start + chunk] = (rows / s[:, None]).round_().clamp_(-127, 127)  # w itself is left as it was
        scale[start : start + chunk] = s
    return q, scale


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T + bias: int8 weight, one fp32 scale per output row (see the module's docstring).

    Smoothed (smoothed=(q_s, scale_s, in_scale)), fbgemm's packed copy holds the weight with its columns times s,
    q_s * scale_s, and its inputs are multiplied by in_scale = 1 / s first; q and scale stay the weight as it is, for
    the other kernels and the embedding, which take the activations unrounded (there smoothing would only move
    rounding into the weight)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 smoothed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, fbgemm: bool = True):
        super().__init__()
        self.out_features, self.in_features = q.shape
        # Parameters (frozen) rather than buffers: they are the model's weights, counted by num_params() as such.
        self.weight = nn.Parameter(q, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.register_buffer("scale", scale)
        self.register_buffer("kernel_scale", scale.to(ACTIVATION_DTYPE))  # int8pack wants it in x's dtype
        self.register_buffer("in_scale", None if smoothed is None else smoothed[2])  # fbgemm's inputs only
        # fbgemm False: no packed copy, one row on int8pack (as where fbgemm is missing; for comparisons)
        self._packed = _pack(*(smoothed[:2] if smoothed is not None else (q, scale)), self.bias) if fbgemm else None

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None,
                   smooth: torch.Tensor | None = None, fbgemm: bool = True) -> "Int8Linear":
        """The layer for y = x @ weight.T + bias; smooth (in_features,): fbgemm's copy smoothed by it."""
        if smooth is None or not fbgemm or not _fbgemm_works():
            return cls(*quantize_rows(weight), bias, fbgemm=fbgemm)
        return cls(*quantize_rows(weight), bias, (*quantize_rows(weight, columns=smooth), smooth.reciprocal()))

    @classmethod
    def of(cls, layer: "Int8Linear") -> "Int8Linear":
        """A layer of this class over `layer`'s own tensors and packed copy (nothing quantized or packed again)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.out_features, new.in_features = layer.out_features, layer.in_features
        new.weight, new.bias = layer.weight, layer.bias
        for name in ("scale", "kernel_scale", "in_scale"):
            new.register_buffer(name, getattr(layer, name))
        new._packed = layer._packed
        new.train(layer.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == self.in_features and self._packed is not None:  # one row: fbgemm takes it in any shape
            x = x if x.dtype == torch.float32 else x.float()
            return fbgemm_linear(x if self.in_scale is None else x * self.in_scale, self._packed, _reduce_range())
        rows = x.reshape(-1, self.in_features)
        if rows.size(0) <= FEW_ROWS:
            y = torch._weight_int8pack_mm(rows.to(ACTIVATION_DTYPE), self.weight, self.kernel_scale).float()
            y = y if self.bias is None else y + self.bias
        else:
            y = self._blockwise(rows.float())
        return y.view(*x.shape[:-1], self.out_features)

    def _blockwise(self, rows: torch.Tensor) -> torch.Tensor:
        """rows @ (q * scale).T + bias, the weight dequantized BLOCK_ROWS output rows at a time."""
        y = torch.empty(rows.size(0), self.out_features, dtype=torch.float32)
        for a in range(0, self.out_features, BLOCK_ROWS):
            w = self.weight[a : a + BLOCK_ROWS].float().mul_(self.scale[a : a + BLOCK_ROWS, None])
            y[:, a : a + BLOCK_ROWS] = self.dense(rows, w, None if self.bias is None else self.bias[a : a + BLOCK_ROWS])
        return y

    def dense(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """One dequantized block's fp32 product (gpt2port.fast swaps in a faster kernel)."""
        return F.linear(rows, weight, bias)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight this layer stands for (for checks and verify's stage comparisons)."""
        return self.weight.float() * self.scale[:, None]


def _pack(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """The weight packed for fbgemm's int8 kernel (a copy of q in its own layout), or None where it is missing."""
    return _prepack(q, scale, bias) if _fbgemm_works() else None


def _prepack(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    with warnings.catch_warnings():  # PyTorch flags its quantized tensor types as deprecated; the kernel is current
        warnings.simplefilter("ignore")
        zero = torch.zeros(q.size(0), dtype=torch.long)
        return torch.ops.quantized.linear_prepack(torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0),
                                                  bias)


@functools.cache
def _fbgemm_works() -> bool:
    """Whether this PyTorch has fbgemm's dynamic int8 linear and it computes what it should, on a tiny probe."""
    try:
        if "fbgemm" not in torch.backends.quantized.supported_engines:
            return False
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(8, 64, generator=g), torch.randn(1, 64, generator=g)
        q, scale = quantize_rows(w)
        y = fbgemm_linear(x, _prepack(q, scale, None), _reduce_range())
        return bool(torch.allclose(y, F.linear(x, q.float() * scale[:, None]), rtol=5e-2, atol=5e-2))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


@functools.cache
def _int8pack_works() -> bool:
    """Whether this PyTorch has the int8 weight-packed kernel (a private op) and it computes what it should, on a
    tiny probe (a private generator)."""
    try:
        g = torch.Generator().manual_seed(0)
        q, scale = quantize_rows(torch.randn(8, 64, generator=g))
        x = torch.randn(3, 64, generator=g)
        y = torch._weight_int8pack_mm(x.to(ACTIVATION_DTYPE), q, scale.to(ACTIVATION_DTYPE)).float()
        return bool(torch.allclose(y, F.linear(x, q.float() * scale[:, None]), rtol=5e-2, atol=5e-2))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def fbgemm_linear(x: torch.Tensor, packed, reduce_range: bool) -> torch.Tensor:
    """fbgemm's dynamic int8 linear. Called plainly, PyTorch looks up __torch_function__ on each argument, and on the
    packed weight (a TorchScript object) that lookup fails by way of a C++ exception, several us a product; with
    subclasses' __torch_function__ off (none of these arguments is a subclass) the object goes straight through."""
    with torch._C.DisableTorchFunctionSubclass():
        return _fbgemm_op()(x, packed, reduce_range)


@functools.cache
def _fbgemm_op():
    """The overload's own C++ entry where PyTorch exposes it: its Python __call__ first scans the arguments for the
    fake script objects of torch.export, a few us a product (a decode step makes ~50)."""
    op = torch.ops.quantized.linear_dynamic.default
    return getattr(op, "_op", op)


@functools.cache
def _reduce_range() -> bool:
    """7-bit activations, unless the CPU has VNNI: without it fbgemm's int16 intermediate sums can saturate on full
    8-bit activations; with it (and on other CPUs' kernels) the full range halves the rounding error."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return not any(f in flags.split() for f in ("avx512_vnni", "avx_vnni"))


class Int8Embedding(nn.Module):
    """Rows of an int8 matrix, scaled back to fp32 on lookup; shares its matrix with the tied head."""

    def __init__(self, table: Int8Linear):
        super().__init__()
        self.table = table  # not a copy: the head itself

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.table.weight).float() * self.table.scale[idx].unsqueeze(-1)


def linear_names(model: nn.Module) -> list[str]:
    """The model's Linear layers by module name (the matrices that become int8), head last."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def quantized_model(cls, path, device=None, smoothing: bool = True, fbgemm: bool = True):
    """A GPT whose matrices are int8 (see the module's docstring), built from the checkpoint at `path`; smoothing
    False quantizes every matrix as it is, fbgemm False leaves one row to int8pack (both for comparisons)."""
    if device is not None and torch.device(device).type != "cpu":
        raise GPT2PortError(f"dtype int8 runs on the CPU (PyTorch's int8 kernel); got device {device}")
    if not _int8pack_works():
        raise GPT2PortError(f"dtype int8 needs PyTorch's int8 weight-packed kernel (torch._weight_int8pack_mm), "
                            f"which this PyTorch ({torch.__version__}) lacks or computes wrongly")
    model, reader = start_quantizing(cls, path, INT8)
    try:
        model.eval()
        _quantize_matrices(model, reader, smoothing and fbgemm, fbgemm)
    finally:
        reader.close()
    huge_pages([p.data_ptr() for p in model.parameters()])
    model.quantized = INT8
    return model.eval()  # the int8 layers too: they were made after the calibration's eval()


def start_quantizing(cls, path, label: str):
    """(a GPT of the checkpoint at `path` on the meta device but for its norms, biases and position table, loaded
    in fp32; the checkpoint's reader, open: the caller closes it): what quantizing to `label` at load starts from,
    here and in gpt2port.quant4. Only GPT-2's tied head is taken."""
    from gpt2port.checkpoint import WEIGHTS, check_weights, read_config, resolve
    from gpt2port.formats.safetensors import SafetensorsReader

    ckpt_dir = resolve(path)
    config = read_config(ckpt_dir)
    if not config.tie_word_embeddings:
        raise GPT2PortError(f"{ckpt_dir}: dtype {label} supports GPT-2's tied head; this checkpoint's head is separate")
    check_weights(ckpt_dir / WEIGHTS, config)  # the names, shapes and dtypes the model expects, or one clear line
    with torch.device("meta"):
        model = cls(config)
    model.checkpoint_dir = ckpt_dir
    # Each tensor is read with pread rather than memory-mapped: the file's pages never count in this process's
    # memory, so the peak is the quantized model plus the matrices being quantized, not the checkpoint's size.
    reader = SafetensorsReader(ckpt_dir / WEIGHTS)
    matrices = {f"{n}.weight" for n in linear_names(model) if n != "lm_head"} | {"tok_emb.weight"}
    try:
        # Norms, biases and the position table first, as they are (fp32): int8's calibration runs the blocks with them.
        small = {k: reader.read(k).float() for k in reader.tensors if k not in matrices}
        missing, unexpected = model.load_state_dict(small, assign=True, strict=False)
        unloaded = [k for k in missing if k not in matrices | {"lm_head.weight"}]
        if unloaded or unexpected:
            raise GPT2PortError(f"{ckpt_dir}: internal error quantizing: unloaded {unloaded}, unexpected {unexpected}")
    except BaseException:
        reader.close()
        raise
    return model, reader


def _quantize_matrices(model: nn.Module, reader, smoothing: bool, fbgemm: bool) -> None:
    """Every matrix of the model made int8 in place, block by block, the head last (once, shared with the embedding),
    each smoothed where the fp32 model's inputs to it have outlier channels (see the module's docstring)."""
    config = model.config
    buffer = torch.empty(reader.largest(), dtype=torch.uint8)
    T = min(CALIBRATION_TOKENS, config.n_positions)
    ids = torch.randint(0, config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    ids[0, 0] = min(config.vocab_size - 1, 50256)  # <|endoftext|> first, as GPT-2's documents start
    # Read once: the buffer holds nothing else (a block's matrices get their own memory), so the head quantized last
    # is still this tensor.
    table = reader.read("tok_emb.weight", into=buffer)
    with torch.no_grad():
        h = table[ids].float() + model.pos_emb.weight[:T]
    name_of = {id(m): name for name, m in model.named_modules()}
    for block in model.blocks:
        layers = [block.attn.qkv, block.attn.proj, block.mlp.fc, block.mlp.proj]
        for layer in layers:  # this block's matrices in fp32, into the model's own layers, for one forward
            layer.weight = nn.Parameter(reader.read(f"{name_of[id(layer)]}.weight").float(), requires_grad=False)
        h, inputs = _inputs(layers, lambda: block(h))
        for layer in layers:
            owner, attr = _owner(model, name_of[id(layer)])
            smooth = _smoothing(inputs[layer], layer.weight) if smoothing else None
            setattr(owner, attr, Int8Linear.from_float(layer.weight, layer.bias, smooth, fbgemm))
    with torch.no_grad():
        head_inputs = model.final_norm(h).flatten(0, 1)
    head = Int8Linear.from_float(table, None, _smoothing(head_inputs, table) if smoothing else None, fbgemm)
    model.lm_head, model.tok_emb = head, Int8Embedding(head)


def _inputs(layers: list[nn.Module], run) -> tuple[torch.Tensor, dict[nn.Module, torch.Tensor]]:
    """run()'s result, and the (tokens, in_features) inputs run() fed each layer."""
    seen: dict[nn.Module, torch.Tensor] = {}

    def record(layer, args):
        seen[layer] = args[0].detach().flatten(0, -2).clone()

    hooks = [layer.register_forward_pre_hook(record) for layer in layers]
    try:
        with torch.no_grad():
            result = run()
    finally:
        for hook in hooks:
            hook.remove()
    return result, seen


def _smoothing(x: torch.Tensor, weight: torch.Tensor, chunk: int = 4096) -> torch.Tensor | None:
    """s per input channel for fbgemm's copy of `weight`, given x (tokens, in_features), the calibration's inputs to
    it; None where they have no outlier channels, or where no a strays less than not smoothing."""
    if not _fbgemm_works():
        return None
    a = x.abs().amax(dim=0)
    median = a.median()
    if median <= 0 or a.max() < OUTLIER_RATIO * median:
        return None
    w = torch.zeros(weight.size(1))
    for start in range(0, weight.size(0), chunk):  # max |w_j| per column, a chunk of rows at a time (the head)
        w = torch.maximum(w, weight[start : start + chunk].float().abs().amax(dim=0))
    rows = weight[:: max(1, weight.size(0) // SEARCH_ROWS)].float()
    ref = x @ rows.T
    best, least = None, _fbgemm_error(x, rows, None, ref)
    for alpha in SMOOTHING_ALPHAS:
        s = a.clamp(min=1e-5) ** alpha / w.clamp(min=1e-5) ** (1 - alpha)
        # Only ever shrink a channel's inputs (relative to the median channel's): one that was quiet over the
        # calibration's tokens may not be on the next, and amplified it would take the whole range (seen: a 30x MLP
        # unit, off for all 32 tokens, then on: 0.78 relative error in that product).
        s = (s / s.median()).clamp(min=1.0)
        err = _fbgemm_error(x, rows, s, ref)
        if err < least:
            best, least = s, err
    return best


def _fbgemm_error(x: torch.Tensor, rows: torch.Tensor, s: torch.Tensor | None, ref: torch.Tensor) -> float:
    """Squared error of fbgemm's x @ rows.T, one token at a time as decoding runs it, smoothed by s (or not)."""
    packed = _prepack(*quantize_rows(rows, columns=s), None)
    xs = x if s is None else x / s
    y = torch.cat([fbgemm_linear(xs[t : t + 1], packed, _reduce_range()) for t in range(x.size(0))])
    return float((y - ref).pow(2).sum())


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, attr = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), attr


_MADV_HUGEPAGE, _MADV_COLLAPSE, _HUGE = 14, 25, 2 << 20


def huge_pages(addresses: list[int]) -> int:
    """Back the process's anonymous mappings that hold any of `addresses` with 2 MB pages, now (Linux >= 6.1:
    madvise MADV_HUGEPAGE, then MADV_COLLAPSE on their 2 MB-aligned interior); bytes collapsed. fbgemm allocates its
    packed copies itself, beside the int8 matrices: their mappings are found in /proc/self/maps, an OS interface,
    not in any allocator's internals. Where anything is missing (another OS, an older kernel, THP off) nothing
    changes but speed."""
    if sys.platform != "linux":
        return 0
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.restype, madvise.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return 0
    done = 0
    for line in lines:
        fields = line.split()
        if len(fields) > 6 or (len(fields) == 6 and fields[5] != "[heap]") or not fields[1].startswith("rw"):
            continue  # a file, the stack, or read-only: only the heap and anonymous mappings
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        start, end = -(-lo // _HUGE) * _HUGE, hi // _HUGE * _HUGE
        if end - start < _HUGE or not any(lo <= a < hi for a in addresses):
            continue
        if madvise(start, end - start, _MADV_HUGEPAGE) == 0 and madvise(start, end - start, _MADV_COLLAPSE) == 0:
            done += end - start
    return done
