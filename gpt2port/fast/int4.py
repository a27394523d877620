"""gpt2port's int4 kernel (int4.c, built into the library of gpt2port/fast/native.py, registered as
torch.ops.gpt2port.matvec_int4 and dequantize_int4; the quantizer through ctypes), checked before use, and the
loader of an int4 model (gpt2port.quant4 holds the layout and the layers).

The kernel is what an int4 model runs on (gpt2port.quant4 refuses to load without it): `why_not()` builds or loads
the library (once per machine, under its lock, with its one line on stderr), then runs the operators and the
quantizer on a probe against plain PyTorch (quant4.dequantize and F.linear), and says why not where anything fails.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from gpt2port.errors import GPT2PortError
from gpt2port.fast import native
from gpt2port.quant4 import CANDIDATE_STEP, CANDIDATES, INT4, Int4Embedding, Int4Linear, bits_for, dequantize, \
    padded, round_activations, row_bytes

# Stored bytes of a matrix read and quantized at a time, at load
CHUNK_BYTES = 8 << 20


@functools.cache
def why_not() -> str | None:
    """None where the int4 operators are built, registered and agree with plain PyTorch on a probe; else why not."""
    built = native.kernels()
    if built.lib is None:
        return built.why_not
    if built.binding_why_not is not None:
        return built.binding_why_not
    if _quantizer() is None:
        return f"{built.lib._name} has no int4 quantizer"
    return None if _agrees() else "gpt2port's int4 kernel disagrees with PyTorch on a probe"


@functools.cache
def _quantizer():
    """The library's quantizer (int4.c), through ctypes: it runs once per matrix, at load."""
    fn = getattr(native.kernels().lib, "gpt2port_quantize_int4", None)
    if fn is not None:
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2 + [ctypes.c_float, ctypes.c_int]
    return fn


def quantize(w: torch.Tensor, bits: int = 4, out: torch.Tensor | None = None) -> torch.Tensor:
    """The packed rows (N, row_bytes(K, bits)) uint8 of a weight (N, K), `bits` 4, 6 or 8, on the kernel's quantizer
    (gpt2port.quant4 says how), into `out` (contiguous) if given; why_not() must have said None."""
    N, K = w.shape
    rows = w.float().contiguous() if padded(K) == K else F.pad(w.float(), (0, padded(K) - K))
    out = torch.empty(N, row_bytes(K, bits), dtype=torch.uint8) if out is None else out
    _quantizer()(rows.data_ptr(), out.data_ptr(), N, padded(K), bits, CANDIDATES, CANDIDATE_STEP,
                 torch.get_num_threads())
    return out


def _agrees() -> bool:
    """The operators against plain PyTorch (activations rounded as quant4.round_activations says) on the quantizer's
    own output, from a private generator: one row and many, with and without bias, widths of one and several groups
    and rows that leave a remainder over the streams, at 1 and 2 threads; and the quantizer's error within a 4-bit
    code's."""
    g = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    try:
        for (n, k), bits in zip(((37, 64), (8, 32), (130, 768), (9, 96), (11, 64), (6, 96)), (4, 4, 4, 8, 6, 6)):
            w, x, b = torch.randn(n, k, generator=g) * 0.05, torch.randn(1, k, generator=g), torch.randn(n, generator=g)
            packed = quantize(w, bits)
            ref_w = dequantize(packed, k)
            if not bool(((ref_w - w).abs() <= (w.amax() - w.amin()) / (2**bits - 1)).all()):
                return False
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for bias in (b, None):
                    want = F.linear(round_activations(x), ref_w, bias)
                    y = torch.ops.gpt2port.matvec_int4(x, packed, bias, k)
                    if y.shape != want.shape or not torch.allclose(y, want, rtol=1e-4, atol=1e-4):
                        return False
                if not torch.equal(torch.ops.gpt2port.dequantize_int4(packed, k), ref_w):
                    return False
                rows = torch.randn(3, k, generator=g)
                if not torch.equal(torch.ops.gpt2port.round_int4(rows), round_activations(rows)):
                    return False
    except RuntimeError:
        return False
    finally:
        torch.set_num_threads(before)
    return True


def from_pretrained(path, dtype: str | torch.dtype | None = None, device=None):
    """GPT.from_pretrained, and dtype "int4" besides: the model module knows no speed kernels, so an int4 model is
    made here (what `generate` and `eval` call)."""
    from gpt2port.model import GPT

    if isinstance(dtype, str) and dtype.lower() == INT4:
        return quantized_model(GPT, path, device)
    return GPT.from_pretrained(path, dtype=dtype, device=device)


def quantized_model(cls, path, device=None):
    """A GPT whose matrices are int4 (see the module's docstring), built from the checkpoint at `path`."""
    from gpt2port.quant import _owner, huge_pages, linear_names, start_quantizing

    if device is not None and torch.device(device).type != "cpu":
        raise GPT2PortError(f"dtype int4 runs on the CPU (gpt2port's int4 kernel); got device {device}")
    missing = why_not()
    if missing is not None:
        raise GPT2PortError(f"dtype int4 needs gpt2port's int4 kernel, which is not available here: {missing}")
    model, reader = start_quantizing(cls, path, INT4)
    try:
        names = [f"{n}.weight" for n in linear_names(model) if n != "lm_head"] + ["tok_emb.weight"]
        staging = _Staging(reader, names)
        for name in linear_names(model):
            if name != "lm_head":
                owner, attr = _owner(model, name)
                setattr(owner, attr, _layer(reader, f"{name}.weight", getattr(owner, attr).bias, bits_for(name),
                                            staging))
        head = _layer(reader, "tok_emb.weight", None, bits_for("lm_head"), staging)
        del staging
    finally:
        reader.close()
    model.lm_head, model.tok_emb = head, Int4Embedding(head)
    huge_pages([t.data_ptr() for t in (*model.parameters(), *model.buffers())])
    model.quantized = INT4
    return model.eval()


def _chunk_rows(info) -> int:
    """Rows of a stored matrix read and quantized at a time: CHUNK_BYTES of them, at least one."""
    (N, K), size = info.shape, info.dtype.itemsize
    return max(1, min(N, CHUNK_BYTES // (K * size)))


class _Staging:
    """The buffers a load reads its matrices' chunks into (and widens fp16/bf16 chunks into), allocated once before
    any matrix is quantized: a buffer per matrix, freed after it, left a hole under the next matrix's packed rows each
    time, ~500 MB of the peak at 1.5B that the allocator could not give back."""

    def __init__(self, reader, names: list[str]):
        chunks = [(_chunk_rows(reader.tensors[n]) * reader.tensors[n].shape[1], reader.tensors[n].dtype.itemsize)
                  for n in names]
        self.bytes = torch.empty(max(n * size for n, size in chunks), dtype=torch.uint8)
        self.floats = torch.empty(max((n for n, size in chunks if size != 4), default=0))


def _layer(reader, name: str, bias: torch.Tensor | None, bits: int, staging: _Staging) -> Int4Linear:
    """The checkpoint's matrix `name` quantized CHUNK_BYTES of its stored rows at a time, read into the load's staging
    buffers: no whole fp32 copy of it is ever held (the tied head's was 154 MB at 124M, the load's peak)."""
    info = reader.tensors[name]
    (N, K), size = info.shape, info.dtype.itemsize
    out = torch.empty(N, row_bytes(K, bits), dtype=torch.uint8)
    rows = _chunk_rows(info)
    stream = reader.stream(name)
    try:
        for a in range(0, N, rows):
            n = min(rows, N - a)
            view, got = staging.bytes[: n * K * size].numpy(), 0
            while got < len(view):
                got += stream.readinto(view[got:])  # no loans: the source's hash reads these bytes itself
            chunk = staging.bytes[: n * K * size].view(info.dtype).view(n, K)
            if info.dtype != torch.float32:  # widened into the staging floats, not a new tensor per chunk
                chunk = staging.floats[: n * K].view(n, K).copy_(chunk)
            quantize(chunk, bits, out[a : a + n])
        stream.finish()
    finally:
        stream.close()
    return Int4Linear(out, K, bias)
