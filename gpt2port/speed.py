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
    """Bytes/s streamed by a one-row fp32 product against a PROBE_BYTES weight: the faster of F.linear and, on CPU,
    gpt2port's own Linear (oneDNN), so that no kernel the model uses beats the floor it defines."""
    from gpt2port.kernels import Linear

    n = int((PROBE_BYTES // 4) ** 0.5)
    w = torch.randn(n, n, device=device)
    x = torch.randn(1, n, device=device)
    products = [lambda: torch.nn.functional.linear(x, w)]
    if torch.device(device).type == "cpu":
        layer = Linear(n, n, bias=False, device="meta")
        layer.weight = torch.nn.Parameter(w, requires_grad=False)
        products.append(lambda: layer(x))
    best = float("inf")
    with torch.inference_mode():
        for product in products:
            product()
            for _ in range(repeats):
                best = min(best, timed(product, device))
    return w.numel() * w.element_size() / best


def timed(fn, device: str | torch.device = "cpu") -> float:
    """Seconds fn() takes, the device synchronized before and after."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t
