"""How fast each CPU kernel a decode step can use streams one weight matrix for one token, at GPT-2's shapes.

A decode step multiplies one row of activations by every weight matrix once, so its speed is the bytes of weight
each kernel streams per second. Here each matrix shape of GPT-2 124M (and the large square probe that
gpt2port.speed uses for the bandwidth floor) is multiplied by one row, with enough distinct copies of the weight
(~400 MB of fp32, ~100 MB of int8) that they come from memory rather than cache, as in a real step.

Kernels: fp32 on oneDNN (gpt2port's Linear), fp32 on F.linear (MKL, as HF), int8 on fbgemm
(torch.ops.quantized.linear_dynamic, what `--dtype int8` decodes with) and on torch._weight_int8pack_mm with bf16
activations (its fallback).

Usage (from the repository root):  python -m scripts.bench_matvec [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from gpt2port import quant

SHAPES = [(2304, 768), (768, 768), (3072, 768), (768, 3072), (50257, 768), (8192, 8192)]  # (out, in)
FP32_BYTES, INT8_BYTES = 400_000_000, 100_000_000


def seconds_per_product(products, repeats: int = 5) -> float:
    """Best-of-`repeats` time of running every product once, per product."""
    for p in products:
        p()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for p in products:
            p()
        best = min(best, time.perf_counter() - t)
    return best / len(products)


def kernels(n: int, k: int) -> dict[str, float]:
    """GB/s of weight streamed by each kernel for one row against an (n, k) weight."""
    x = torch.randn(1, k)
    fp32 = [torch.randn(n, k) for _ in range(max(1, FP32_BYTES // (4 * n * k)))]
    int8 = [quant.quantize_rows(torch.randn(n, k)) for _ in range(max(1, INT8_BYTES // (n * k)))]
    xb = x.to(quant.ACTIVATION_DTYPE)
    out = {
        "fp32 oneDNN": (fp32, 4, lambda w: lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")),
        "fp32 F.linear": (fp32, 4, lambda w: lambda: F.linear(x, w)),
        "int8pack bf16": (int8, 1, lambda qs: (lambda s: lambda: torch._weight_int8pack_mm(xb, qs[0], s))(
            qs[1].to(quant.ACTIVATION_DTYPE))),
    }
    if quant._fbgemm_works():
        out["int8 fbgemm"] = (int8, 1, lambda qs: (lambda p: lambda: torch.ops.quantized.linear_dynamic.default(
            x, p, quant._reduce_range()))(quant._pack(qs[0], qs[1], None)))
    rates = {}
    with torch.inference_mode():
        for name, (weights, size, make) in out.items():
            rates[name] = n * k * size / seconds_per_product([make(w) for w in weights]) / 1e9
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads; GB/s of weight streamed for one token")
    header = None
    for n, k in SHAPES:
        rates = kernels(n, k)
        if header is None:
            header = list(rates)
            print(f"| {'weight (out, in)':<17} | " + " | ".join(header) + " |")
            print("|---|" + "---:|" * len(header))
        print(f"| {f'{n} x {k}':<17} | " + " | ".join(f"{rates[h]:.1f}" for h in header) + " |", flush=True)


if __name__ == "__main__":
    main()
