"""How fast decoding could go: the memory-bandwidth floor that `generate --verbose` and scripts/bench/generate.py
compare a decode rate with.

One decode step must read every weight once (the position table excepted: one row of it), and little else, so
tokens/s can never beat bandwidth / bytes of weights per token. The bandwidth is measured here, on the device, by
the product that dominates a step: one row against a weight far larger than any cache.
"""

from __future__ import annotations

import time

import torch

from gpt2port.fast import native
from gpt2port.fast.kernels import LINEAR, choose, product
from gpt2port.fast.settings import Settings

PROBE_BYTES = 256 << 20
GPU_PROBE_FACTOR, GPU_BATCH = 4, 10


def weight_bytes_per_token(model) -> int:
    """Bytes a decode step must stream: every parameter and buffer of the model once (int8 matrices at one byte,
    their scales included), except all but one row of the position table."""
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if t.data_ptr() in seen:  # a tied head is the embedding: read once
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    pos = model.pos_emb.weight
    return total - (pos.size(0) - 1) * pos.size(1) * pos.element_size()


def matvec_bandwidth(device: str | torch.device = "cpu", repeats: int = 20) -> float:
    """Bytes/s streamed by a one-row product against a PROBE_BYTES weight: the fastest of fp32 F.linear and, on CPU,
    oneDNN and gpt2port's one-row kernel (gpt2port/fast/native.py) where built, on a GPU bf16 F.linear, so that no
    kernel the model uses beats the floor it defines. On a GPU the weight is up to GPU_PROBE_FACTOR times larger (a
    quarter of the free memory at most) and each timing spans GPU_BATCH products: one product there takes ~0.1 ms, of
    the order of a synchronization."""
    device = torch.device(device)
    if device.type == "cpu":
        return _best_matvec(device, torch.float32, PROBE_BYTES, repeats, 1, cpu_kernels=True)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else PROBE_BYTES * 4
    probe = max(PROBE_BYTES // 4, min(PROBE_BYTES * GPU_PROBE_FACTOR, free // 4))
    return max(_best_matvec(device, dtype, probe, repeats, GPU_BATCH) for dtype in (torch.float32, torch.bfloat16))


def _best_matvec(device: torch.device, dtype: torch.dtype, nbytes: int, repeats: int, batch: int,
                 cpu_kernels: bool = False) -> float:
    n = int((nbytes // dtype.itemsize) ** 0.5)
    w = torch.randn(n, n, device=device, dtype=dtype)
    x = torch.randn(1, n, device=device, dtype=dtype)
    kinds = {LINEAR}
    if cpu_kernels:  # whatever choose() would take for one row, and oneDNN besides
        kinds |= {choose(w, None, 1, Settings()), choose(w, None, 1, Settings(native=False))}
    best = float("inf")
    with torch.inference_mode():
        for kind in sorted(kinds):
            product(kind, x, w, None)
            for _ in range(repeats):
                best = min(best, timed(lambda: [product(kind, x, w, None) for _ in range(batch)], device) / batch)
    return w.numel() * w.element_size() / best


def decode_report(model, device: str | torch.device, rate: float, how: str | None = None) -> list[str]:
    """What `generate --verbose` says of a decode that ran at `rate` tokens/s: its fraction of the floor measured
    now, what the steps ran on (`how`, as generate reported it), and what made them slower than they could be."""
    bandwidth, per_token = matvec_bandwidth(device), weight_bytes_per_token(model)
    floor = bandwidth / per_token
    lines = [f"decode at {rate / floor:.0%} of the memory-bandwidth floor ({floor:.1f} tokens/s: "
             f"{per_token / 1e6:.0f} MB of weights per token, {bandwidth / 1e9:.1f} GB/s measured now)"]
    if how is not None:
        lines.append(f"decode steps ran on {how}")
    weight = model.lm_head.weight
    if weight.device.type == "cpu" and weight.dtype in native.FUNCTIONS:
        lines.append(f"one-row products on {choose(weight, None, 1, Settings.from_env())}, several rows on "
                     f"{choose(weight, None, 2, Settings.from_env())}")
        built = native.kernels() if Settings.from_env().native else None
        if built is not None and built.why_not is not None:
            lines.append(f"gpt2port's one-row kernel is not in use: {built.why_not}")
        elif built is not None and built.binding_why_not is not None:
            lines.append(f"gpt2port's one-row kernel is reached through Python, a few us slower a product: "
                         f"{built.binding_why_not}")
    if model.quantized == "int8":
        from gpt2port.quant import Int8Linear

        layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
        smoothed = sum(m.in_scale is not None for m in layers)
        lines.append(f"int8: {smoothed} of {len(layers)} products smoothed against outlier input channels")
    return lines


def timed(fn, device: str | torch.device = "cpu") -> float:
    """Seconds fn() takes, the device synchronized before and after."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t
