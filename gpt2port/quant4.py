"""int4 weight-only inference (`generate`/`eval --dtype int4`, gpt2port.fast.int4.from_pretrained(path, "int4")):
the packed layout and the layers. The kernel, the quantizer and the loader are in gpt2port's speed package
(gpt2port/fast/int4.py, int4.c), which the layers reach through their operators.

Every matrix of the model (the four per block, and the token embedding, which is also the tied head) is stored in
groups of GROUP numbers along its input dimension, each group as codes, a scale byte c and a zero byte z (int8) under
the row's fp32 base: w ~= s * (code - 2^(bits - 1) + z * u), s = base * 2^(-c / 32), u = 2^bits / 256 codes (so the
group's middle sits within half its range of 0, to 1/16 of a 4-bit step). Two bytes a group, where an fp16 scale and
minimum took four: 4.5 bits per weight at 4-bit codes (was 5), as llama.cpp's Q4_K, whose 6-bit scales and minimums
are linear under a pair per 256 numbers; a scale's 2^(1/32) steps are even across magnitudes (eight octaves below
the row's largest group), and codes are rounded against the stored pair. At 4 bits the squared error is that of fp16
scales and minimums (within 0.5%); at 6 and 8 bits, where codes are fine enough for the scale's steps to show, 8% and
23% above it (scripts/bench/int4_error.py: the logits' KL divergence moves by less than its noise at 8 bits).
Most matrices take 4-bit codes (0..15); the tied head and each block's q/k/v matrix (BITS, HEAD_BITS) take 8-bit codes
(8.5 bits per weight), as llama.cpp's Q4_K_M gives its head and half its q/k/v matrices Q6_K: on trained-like weights
4-bit codes there cost far more than elsewhere. 6-bit codes (6.5 bits per weight) are the other choice
(docs/performance.md has both side by side). The tied matrix is held once. Norms, biases and the position table stay
fp32.

Each group's scale and minimum are fitted, not just taken from its range: over candidate scales around
(max - min) / 15 (or 255) the codes are rounded, the scale and minimum refitted to them by least squares, and the
pair with the least squared error kept (llama.cpp's make_qkx2_quants does the same for Q4_K, there with weights).
A group lying far to one side of 0, beyond its zero's reach, takes the least scale that reaches it (no worse than
rounding its largest magnitude). The row's base is its largest fitted scale two steps up; each group then tries the
four stored scales nearest its own, each with the zeros nearest its minimum (down, up, and the nearest that leaves
no number outside the codes' range), refitted once to the codes, and keeps the pair with the least squared error.
A row holding a NaN or an infinity gets a NaN base, so every number of it reads back NaN and no product hides it.
scripts/bench/int4_error.py compares the logits' KL divergence from fp32 with llama.cpp's Q4_K_M on the same weights
(docs/performance.md).

Activations are rounded to 8 bits per group of GROUP before every product (round_activations, as llama.cpp rounds
them for its 4-bit types): the kernel then multiplies codes by them in integer dot products where the CPU has them
(int4.c), which a decode step's speed depends on; every path computes the same numbers up to the order of the sums.
One row (a decode step) is multiplied by the packed bytes as they are (torch.ops.gpt2port.matvec_int4, which rounds
the row itself); many rows (a prompt, eval) by BLOCK_ROWS output rows at a time dequantized to fp32
(torch.ops.gpt2port.dequantize_int4), each block multiplied by the rounded rows while it is in cache (on oneDNN once
gpt2port.fast.accelerate swaps its kernels in). Without the kernel (no C compiler, GPT2PORT_NATIVE=0) or on another
device, loading refuses in one line: a model that computed at a fraction of fp32's speed would be no use. The
matrices are quantized at load, one at a time, from the checkpoint's tensors in whatever dtype they are stored.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


GROUP = 32
# 2^(-j / 32) for j = 0..31 and 2^(-j) for j = 0..7, in fp32 (int4.h's SCALE_STEP)
SCALE_STEPS = torch.tensor([2.0 ** (-j / 32) for j in range(32)])
POWERS = torch.tensor([2.0**-j for j in range(8)])
# A zero byte's unit: 2^(bits - ZERO_SHIFT) codes (int4.h's)
ZERO_SHIFT = 8
# Candidate scales: span / (15 + CANDIDATE_STEP * i) for |i| <= CANDIDATES (make_qkx2_quants': -1 .. 1 by 0.1)
CANDIDATES, CANDIDATE_STEP = 10, 0.1


def padded(k: int) -> int:
    """The input width a packed row holds: k rounded up to whole groups (the padding's weights are zero)."""
    return -(-k // GROUP) * GROUP


def row_bytes(k: int, bits: int = 4) -> int:
    """Bytes of one packed row of k numbers: `bits`-bit codes (4, 6 or 8), scale bytes, zero bytes, the fp32 base
    (int4.c's layout)."""
    return padded(k) * bits // 8 + 2 * (padded(k) // GROUP) + 4


def bits_for(name: str) -> int:
    """The code width of the model's matrix of module `name` (gpt2port's names; "lm_head": the tied head)."""
    if name == "lm_head":
        return HEAD_BITS
    return next((bits for end, bits in BITS.items() if name.endswith(end)), 4)


def bits_of(packed: torch.Tensor, k: int) -> int:
    """The code width of packed rows of k numbers, as their byte count says: 4, 6 or 8."""
    return (packed.size(-1) - 2 * (padded(k) // GROUP) - 4) * 8 // padded(k)


def dequantize(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The fp32 rows (..., k) that packed rows (..., row_bytes(k, bits)) stand for, in plain PyTorch: s * (code + z *
    u), s = base * 2^(-c / 32) (the reference the kernel is checked against)."""
    Kp, G, bits = padded(k), padded(k) // GROUP, bits_of(packed, k)
    lead = packed.shape[:-1]
    flat = packed.reshape(-1, packed.size(-1))
    groups = flat[:, : Kp * bits // 8].reshape(-1, G, 4 * bits)  # each group's bytes
    if bits == 8:
        codes = groups.int()
    else:
        nibbles = groups[..., :16].int()
        codes = torch.cat((nibbles & 15, nibbles >> 4), dim=2)  # (rows, G, 32): low nibbles first
        if bits == 6:  # byte j's bits 2m, 2m + 1: the high bits of element j + 8m
            crumbs = groups[..., 16:24].int()
            high = torch.stack([(crumbs >> 2 * m) & 3 for m in range(4)], dim=2)  # (rows, G, 4, 8): element 8m + j
            codes |= high.flatten(2) << 4
    at = Kp * bits // 8
    c = flat[:, at : at + G].long()
    z = flat[:, at + G : at + 2 * G].contiguous().view(torch.int8).float()
    zu = z * 2.0 ** (bits - ZERO_SHIFT) - 2.0 ** (bits - 1)  # the zero in codes (int4.h's zero_codes)
    base = flat[:, at + 2 * G : at + 2 * G + 4].clone(memory_format=torch.contiguous_format).view(torch.float32)
    s = base * SCALE_STEPS[c & 31] * POWERS[c >> 5]  # int4.h's group_scale: one rounding, then an exact power of two
    w = (codes.float() + zu[..., None]) * s[..., None]
    return w.reshape(*lead, Kp)[..., :k]


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """Activations x (..., k) as the int4 products take them (int4.c rounds them so in C): per group of GROUP along
    the last dimension (the last one filled with zeros), d = max|x| / 127 and q = round(x / d) (ties to even; 0 where
    d is 0), returned as q * d in fp32; a group holding a NaN or an infinity becomes NaN."""
    k = x.size(-1)
    groups = F.pad(x.float(), (0, padded(k) - k)).reshape(*x.shape[:-1], -1, GROUP)
    d = groups.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(groups / d), 0.0)
    out = torch.where(torch.isfinite(groups).all(-1, keepdim=True), q * d, float("nan"))
    return out.reshape(*x.shape[:-1], padded(k))[..., :k]


INT4 = "int4"
# Code widths other than 4, by the end of a matrix's module name (the tied head's is HEAD_BITS)
BITS = {"attn.qkv": 8}
HEAD_BITS = 8
# Output rows dequantized per block for many-row products (as gpt2port.quant's int8: 26 MB of fp32 at 6400 inputs)
BLOCK_ROWS = 1024


class Int4Linear(nn.Module):
    """y = x @ W.T + bias, W held as packed int4 rows (see the module's docstring): one row on gpt2port's kernel,
    many rows on blocks of the weight dequantized to fp32."""

    def __init__(self, packed: torch.Tensor, in_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, packed.size(0)
        self.padded = padded(in_features)
        self.register_buffer("weight", packed)  # bytes, not numbers: a buffer, not a Parameter
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @classmethod
    def of(cls, layer: "Int4Linear") -> "Int4Linear":
        """A layer of this class over `layer`'s own tensors (nothing quantized again)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features, new.padded = layer.in_features, layer.out_features, layer.padded
        new.register_buffer("weight", layer.weight)
        new.bias = layer.bias
        new.train(layer.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x if x.dtype == torch.float32 else x.float()
        if x.numel() == self.in_features:
            return self.matvec(x if self.padded == self.in_features else F.pad(x, (0, self.padded - self.in_features)))
        rows = x.reshape(-1, self.in_features)
        if self.padded != self.in_features:
            rows = F.pad(rows, (0, self.padded - self.in_features))
        rows = torch.ops.gpt2port.round_int4(rows)  # as the one-row kernel rounds them (round_activations)
        y = torch.empty(rows.size(0), self.out_features, dtype=torch.float32)
        for a in range(0, self.out_features, BLOCK_ROWS):
            w = torch.ops.gpt2port.dequantize_int4(self.weight[a : a + BLOCK_ROWS], self.padded)
            y[:, a : a + BLOCK_ROWS] = self.dense(rows, w, None if self.bias is None else self.bias[a : a + BLOCK_ROWS])
        return y.view(*x.shape[:-1], self.out_features)

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """One row (1, ..., padded) -> (1, ..., out_features) on gpt2port's kernel."""
        y = torch.ops.gpt2port.matvec_int4(x, self.weight, self.bias, self.padded)
        return y

    def dense(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """One dequantized block's fp32 product (gpt2port.fast swaps in a faster kernel)."""
        return F.linear(rows, weight, bias)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight this layer stands for, in plain PyTorch (for checks)."""
        return dequantize(self.weight, self.in_features)


class Int4Embedding(nn.Module):
    """Rows of the int4 table, dequantized on lookup; shares its bytes with the tied head."""

    def __init__(self, table: Int4Linear):
        super().__init__()
        self.table = table  # not a copy: the head itself

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        table = self.table
        rows = torch.ops.gpt2port.dequantize_int4(table.weight[idx.reshape(-1)], table.padded)
        return rows[:, : table.in_features].view(*idx.shape, table.in_features)
