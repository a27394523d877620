"""GGML's quantized block types written in numpy, byte for byte what llama.cpp's `llama-quantize` writes.

Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are ggml's `quantize_row_q{4_0,4_1,5_0,5_1,8_0}_ref`, and the K-quants Q4_K, Q5_K and
Q6_K (which llama.cpp's `gguf` package can only read) its `quantize_row_q{4,5,6}_K_ref` (the path llama-quantize
takes without an importance matrix), all vectorized across a chunk of blocks. (The `gguf` package's own ports of the
first five are exact too, but group rows, not blocks: on the (n, 32) chunks here they run 16 blocks per numpy call.)
Bytes decide equality, so every step keeps the C code's arithmetic: float32 throughout, each sum accumulated element
by element in the C loop's order (`_sum`, never numpy's pairwise sum), products and sums rounded one at a time (the
reference is built without FMA contraction), `nearest_int` as round-half-to-even (np.rint), ties in a search kept by
the earlier candidate, and a (scale, min) search whose `min` moves inside the loop as ggml's `make_qkx2_quants` does.
The proof is scripts/check_gguf_kquants.py and tests/formats/test_gguf_kquants.py, against llama-cpp-python's
quantizer.

Reading back is the `gguf` package's dequantizers (which compute as ggml's do), a chunk of blocks at a time.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
F32 = np.float32
QK_K = 256
TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)  # what quantize() writes, dequantize() reads
_CHUNK = 1 << 16  # values per step: the temporaries of a step stay a few MB, in cache as far as they can


def quantize(values: np.ndarray, qtype: Q, threads: int = 1) -> np.ndarray:
    """float32 `values` (rows of a multiple of the type's block size) as GGML `qtype` blocks: uint8, one row of
    bytes per row of values. threads: chunks quantized at once (numpy lets go of the GIL in its loops)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = np.ascontiguousarray(values, dtype=F32).reshape(-1, values.shape[-1])
    if rows.shape[1] % block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block} values, not {rows.shape[1]}")
    flat = rows.reshape(-1, block)
    out = np.empty((len(flat), size), dtype=np.uint8)
    step = max(1, _CHUNK // block)
    encode = _ENCODERS[qtype]

    def one(start: int) -> None:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # per thread: errstate is thread-local
            out[start : start + step] = encode(flat[start : start + step])

    starts = range(0, len(flat), step)
    if threads > 1 and len(starts) > 1:
        with ThreadPoolExecutor(min(threads, len(starts))) as pool:
            list(pool.map(one, starts))
    else:
        for start in starts:
            one(start)
    return out.reshape(*values.shape[:-1], values.shape[-1] // block * size)


def dequantize(raw: np.ndarray, qtype: Q, count: int, out: np.ndarray | None = None) -> np.ndarray:
    """`count` float32 values from whole GGML `qtype` blocks `raw` (uint8), written into `out` where given."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, size)
    if len(blocks) * block != count:
        raise ValueError(f"{raw.size} bytes of {qtype.name} for {count} values")
    out = np.empty(count, dtype=F32) if out is None else out
    values = out.reshape(-1, block)
    step = max(1, _CHUNK // block)
    for start in range(0, len(blocks), step):
        values[start : start + step] = gguf.quants.dequantize(blocks[start : start + step], qtype)
    return out


# --- the reference's arithmetic -----------------------------------------------------------------------------------

def _sum(a: np.ndarray) -> np.ndarray:
    """Sum over axis 0 as `for (i = 0; i < n; ++i) s += a[i]` does in float32. numpy's reduce over the outer axis of
    a C-ordered (k, m) array adds row after row (its pairwise summation applies along the contiguous axis only,
    which is the only axis when m == 1)."""
    if a.shape[1] > 1:
        return np.add.reduce(a, axis=0)
    s = a[0].copy()
    for row in a[1:]:
        s += row
    return s


def _nearest(a: np.ndarray) -> np.ndarray:
    """ggml's nearest_int (adding 1.5 * 2**23 rounds half to even), as float32."""
    return np.rint(a)


def _fp16(a: np.ndarray) -> np.ndarray:
    """The fp16 a float32 is stored as (GGML_FP32_TO_FP16 rounds to nearest even, as numpy does)."""
    return a.astype(np.float16)


def _make_qkx2(x, w, nmax: int, rmin: float, rdelta: float, nstep: int):
    """ggml's make_qkx2_quants on columns: x, w (n, m) float32, one group per column. Returns (levels (n, m),
    scale (m,), the_min (m,)): a group is scale * level - the_min."""
    mx, mn = x.max(axis=0), np.minimum(x.min(axis=0), F32(0))
    sum_w, sum_x = _sum(w), _sum(w * x)
    flat = mx == mn
    lv, t, u = np.empty_like(x), np.empty_like(x), np.empty_like(x)  # reused: no allocation per step

    def quantize_at(iscale):  # lv = clamp(nearest_int(iscale * (x - mn)), 0, nmax)
        np.subtract(x, mn, out=lv)
        np.multiply(lv, iscale, out=lv)
        np.rint(lv, out=lv)
        np.maximum(lv, F32(0), out=lv)
        np.minimum(lv, F32(nmax), out=lv)

    def error(scale, low):  # sum of w * (scale * lv + low - x)^2
        np.multiply(lv, scale, out=t)
        np.add(t, low, out=t)
        np.subtract(t, x, out=t)
        np.square(t, out=t)
        np.multiply(t, w, out=t)
        return _sum(t)

    iscale = F32(nmax) / (mx - mn)
    scale = F32(1) / iscale
    quantize_at(iscale)
    levels, best = lv.copy(), error(scale, mn)
    for step in range(nstep + 1):
        quantize_at((F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / (mx - mn))  # mn as the search moved it
        np.multiply(w, lv, out=t)
        sum_l = _sum(t)
        np.multiply(t, lv, out=u)
        sum_l2 = _sum(u)
        np.multiply(t, x, out=u)
        sum_xl = _sum(u)
        d = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / d
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d
        positive = this_min > 0
        this_min = np.where(positive, F32(0), this_min)
        this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
        cur = error(this_scale, this_min)
        better = (d > 0) & (cur < best)
        np.copyto(levels, lv, where=better)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    levels[:, flat] = 0
    return levels, np.where(flat, F32(0), scale), -mn


def _make_qx(x, nmax: int):
    """ggml's make_qx_quants(n, nmax, x, L, rmse_type=1, NULL) on columns: x (n, m) float32. Returns (levels + nmax
    (n, m), scale (m,))."""
    m = x.shape[1]
    big = np.abs(x).argmax(axis=0)  # the first of equal magnitudes, as `if (ax > amax)` keeps it
    mx = x[big, np.arange(m)]
    zero = np.abs(mx) < F32(1e-15)
    w = x * x
    wx = w * x

    def fit(iscale):
        lv = np.clip(_nearest(iscale * x), -nmax, nmax - 1)
        return lv, _sum(wx * lv), _sum(w * lv * lv)

    levels, sumlx, suml2 = fit(F32(-nmax) / mx)
    scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        lv, sumlx, suml2 = fit(-(F32(nmax) + F32(0.1) * F32(step)) / mx)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        levels = np.where(better, lv, levels)
        scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
    levels = levels + F32(nmax)
    levels[:, zero] = 0
    return levels, np.where(zero, F32(0), scale)


def _columns(blocks: np.ndarray, width: int) -> np.ndarray:
    """Super-blocks (nb, 256) as groups of `width` values, one per column: (width, nb * 256 / width)."""
    return np.ascontiguousarray(blocks.reshape(-1, width).T)


def _q45_k(blocks: np.ndarray, nmax: int, rmin: float, nstep: int):
    """The part quantize_row_q4_K_ref and q5_K_ref share: (d, dmin as fp16 (nb,), 12 packed scale bytes (nb, 12),
    levels (nb, 256))."""
    nb = len(blocks)
    x = _columns(blocks, 32)
    av_x = np.sqrt(_sum(x * x) / F32(32))
    levels, scales, mins = _make_qkx2(x, av_x + np.abs(x), nmax, rmin, 0.1, nstep)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
    inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    # nearest_int's int stored in a uint8 (modulo 256), then capped at 63
    ls = np.minimum(_nearest(inv_scale[:, None] * scales).astype(np.int64) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(_nearest(inv_min[:, None] * mins).astype(np.int64) & 0xFF, 63).astype(np.uint8)
    d, dmin = _fp16(max_scale / F32(63)), _fp16(max_min / F32(63))
    step = (d.astype(F32)[:, None] * ls).reshape(-1)
    shift = (dmin.astype(F32)[:, None] * lm).reshape(-1)
    again = np.clip(_nearest((x + shift) / step), 0, nmax)
    levels = np.where(step != 0, again, levels)  # a group whose scale became 0 keeps its first levels
    packed = np.empty((nb, 12), dtype=np.uint8)
    packed[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return d, dmin, packed, levels.T.astype(np.uint8).reshape(nb, QK_K)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, packed, levels = _q45_k(blocks, 15, -1.0, 20)
    halves = levels.reshape(-1, 4, 2, 32)
    qs = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_bytes(d), _bytes(dmin), packed, qs], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, packed, levels = _q45_k(blocks, 31, -0.5, 15)
    halves = levels.reshape(-1, 4, 2, 32)
    low = halves & 0xF
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = (levels.reshape(-1, 8, 32) >> 4).astype(np.uint8)  # group k's fifth bits go to bit k of qh
    qh = np.zeros((len(blocks), 32), dtype=np.uint8)
    for k in range(8):
        qh |= high[:, k] << k
    return np.concatenate([_bytes(d), _bytes(dmin), packed, qh, qs], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    nb = len(blocks)
    x = _columns(blocks, 16)
    levels, scales = _make_qx(x, 32)
    scales = scales.reshape(nb, 16)
    big = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(nb), big]
    empty = np.abs(max_scale) < F32(1e-15)  # the whole block is written as zeros
    iscale = F32(-128) / max_scale
    d = _fp16(F32(1) / iscale)
    sc = np.minimum(_nearest(iscale[:, None] * scales), 127).astype(np.int8)
    step = (d.astype(F32)[:, None] * sc).reshape(-1)
    again = np.clip(_nearest(x / step), -32, 31) + F32(32)
    levels = np.where(step != 0, again, levels).T.astype(np.uint8).reshape(nb, 2, 4, 32)
    low, high = levels & 0xF, levels >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    out = np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8), _bytes(d)], axis=1)
    out[empty] = 0
    return out


def _bytes(half: np.ndarray) -> np.ndarray:
    return half.reshape(-1, 1).view(np.uint8)


# --- the 32-value types -------------------------------------------------------------------------------------------

def _absmax(blocks: np.ndarray) -> np.ndarray:
    """Each block's value of largest magnitude, with its sign (the first of equal magnitudes, as `amax < |v|` keeps)."""
    return np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)[:, 0]


def _inverse(d: np.ndarray) -> np.ndarray:
    """`d ? 1.0f/d : 0.0f`."""
    return np.where(d != 0, F32(1) / d, F32(0))


def _levels(blocks: np.ndarray, low, inv: np.ndarray, offset: float, top: int) -> np.ndarray:
    """`MIN(top, (int8_t)((x - low) * id + offset))` per value: C's cast truncates toward zero (its argument is
    never below 0 here, nor above 127)."""
    x = blocks if low is None else blocks - low[:, None]
    return np.minimum(np.trunc(x * inv[:, None] + F32(offset)), F32(top)).astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Value j in the low 4 bits of byte j, value j + 16 in its high 4 bits."""
    return (q[:, :16] & 0xF) | (q[:, 16:] << 4)


def _fifth_bits(q: np.ndarray) -> np.ndarray:
    """qh: bit j of a little-endian uint32 is bit 4 of value j."""
    return np.packbits(q >> 4, axis=1, bitorder="little")


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    d = _absmax(blocks) / F32(-8)
    return np.concatenate([_bytes(_fp16(d)), _nibbles(_levels(blocks, None, _inverse(d), 8.5, 15))], axis=1)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    mn = blocks.min(axis=1)
    d = (blocks.max(axis=1) - mn) / F32(15)
    q = _levels(blocks, mn, _inverse(d), 0.5, 15)
    return np.concatenate([_bytes(_fp16(d)), _bytes(_fp16(mn)), _nibbles(q)], axis=1)


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    d = _absmax(blocks) / F32(-16)
    q = _levels(blocks, None, _inverse(d), 16.5, 31)
    return np.concatenate([_bytes(_fp16(d)), _fifth_bits(q), _nibbles(q)], axis=1)


def _q5_1(blocks: np.ndarray) -> np.ndarray:
    mn = blocks.min(axis=1)
    d = (blocks.max(axis=1) - mn) / F32(31)
    q = _levels(blocks, mn, _inverse(d), 0.5, 31)
    return np.concatenate([_bytes(_fp16(d)), _bytes(_fp16(mn)), _fifth_bits(q), _nibbles(q)], axis=1)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    d = np.abs(blocks).max(axis=1) / F32(127)
    x = blocks * _inverse(d)[:, None]
    a = np.abs(x)
    whole = np.floor(a)
    q = np.copysign(whole + np.floor(F32(2) * (a - whole)), x)  # roundf, halves away from zero; exact, where
    # floor(a + 0.5) would round 0.49999997 + 0.5 up to 1
    return np.concatenate([_bytes(_fp16(d)), q.astype(np.int8).view(np.uint8)], axis=1)


_ENCODERS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
             Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}
