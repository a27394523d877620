"""How fast decoding could go: the memory-bandwidth floor that `generate --verbose` and scripts/bench_generate.py
compare a decode rate with.

One decode step must read every weight once (the position table excepted: one row of it), and little else, so
tokens/s can never beat bandwidth / bytes of weights per token. The bandwidth is measured here, on the device, by
the product that dominates a step: one row against a weight far larger than any cache.
"""

from __future__ import annotations

import time

import torch

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
    gpt2port's own Linear (oneDNN), on a GPU bf16 F.linear, so that no kernel the model uses beats the floor it
    defines. On a GPU the weight is up to GPU_PROBE_FACTOR times larger (a quarter of the free memory at most) and
    each timing spans GPU_BATCH products: one product there takes ~0.1 ms, of the order of a synchronization."""
    device = torch.device(device)
    if device.type == "cpu":
        return _best_matvec(device, torch.float32, PROBE_BYTES, repeats, 1, onednn=True)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else PROBE_BYTES * 4
    probe = max(PROBE_BYTES // 4, min(PROBE_BYTES * GPU_PROBE_FACTOR, free // 4))
    return max(_best_matvec(device, dtype, probe, repeats, GPU_BATCH) for dtype in (torch.float32, torch.bfloat16))


def _best_matvec(device: torch.device, dtype: torch.dtype, nbytes: int, repeats: int, batch: int,
                 onednn: bool = False) -> float:
    from gpt2port.kernels import Linear

    n = int((nbytes // dtype.itemsize) ** 0.5)
    w = torch.randn(n, n, device=device, dtype=dtype)
    x = torch.randn(1, n, device=device, dtype=dtype)
    products = [lambda: torch.nn.functional.linear(x, w)]
    if onednn:
        layer = Linear(n, n, bias=False, device="meta")
        layer.weight = torch.nn.Parameter(w, requires_grad=False)
        products.append(lambda: layer(x))
    best = float("inf")
    with torch.inference_mode():
        for product in products:
            product()
            for _ in range(repeats):
                best = min(best, timed(lambda: [product() for _ in range(batch)], device) / batch)
    return w.numel() * w.element_size() / best


def timed(fn, device: str | torch.device = "cpu") -> float:
    """Seconds fn() takes, the device synchronized before and after."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t
