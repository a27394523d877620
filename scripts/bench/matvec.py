"""How fast each CPU kernel a decode step can use streams one weight matrix for one token, at GPT-2's shapes.

A decode step multiplies one row of activations by every weight matrix once, so its speed is the bytes of weight
each kernel streams per second. Here each matrix shape of a GPT-2 size (124M by default; --size gpt2-xl for 1.5B)
and the large square probe that gpt2port.fast.speed uses for the bandwidth floor is multiplied by one row, with enough
distinct copies of the weight (~400 MB of fp32, 200 MB of bf16, 100 MB of int8) that they come from memory rather
than cache, as in a real step. The last row runs the products of one whole step in order, each weight once (124M:
494 MB of fp32, 1.5B: 6.2 GB): what a step's products cost back to back, the most a decode step could reach on that
kernel.

Kernels: fp32 on oneDNN (gpt2port's Linear for several rows), fp32 and bf16 on gpt2port's own one-row kernel
(gpt2port/fast/native.py: what fp32 and bf16 decoding run where it is built), fp32 on F.linear (MKL, as HF), bf16 on
F.linear (what bf16 decoding ran before that kernel), int8 on fbgemm (torch.ops.quantized.linear_dynamic, what
`--dtype int8` decodes with) and on torch._weight_int8pack_mm with bf16 activations (its fallback).

Usage (from the repository root):  python -m scripts.bench.matvec [--size gpt2] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from gpt2port import GPT, quant
from gpt2port.fast import native, speed
from gpt2port.config import GPTConfig, canonical_name

_SIDE = int((speed.PROBE_BYTES // 4) ** 0.5)
PROBE = (_SIDE, _SIDE)  # (out, in): gpt2port.fast.speed's fp32 bandwidth probe
FP32_BYTES = 400_000_000  # of distinct copies per shape, so that each product reads memory, not cache
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "int8": 1, "int8pack": 1}  # per weight, by a kernel's first word


def step_shapes(config: GPTConfig) -> list[tuple[int, int]]:
    """The (out, in) weights of one decode step, in the order the model runs them (read off a meta-device model)."""
    with torch.device("meta"):
        model = GPT(config)
    return [tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def seconds(products, repeats: int = 5) -> float:
    """Best-of-`repeats` time of running every product once."""
    for p in products:
        p()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for p in products:
            p()
        best = min(best, time.perf_counter() - t)
    return best


def kernels(shapes: list[tuple[int, int]]) -> dict[str, float]:
    """GB/s of weight streamed by each kernel for one row against each (n, k) weight of `shapes` in turn."""
    xs = {k: torch.randn(1, k) for _, k in shapes}
    fp32 = [torch.randn(n, k) for n, k in shapes]
    bf16 = [w.bfloat16() for w in fp32]
    int8 = [quant.quantize_rows(w) for w in fp32]
    # kernel -> (its weights, weight -> a function running one product)
    out = {
        "fp32 oneDNN": (fp32, lambda w, x: lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")),
        "fp32 gpt2port": (fp32, lambda w, x: lambda: torch.ops.gpt2port.matvec(x, w, None)),
        "fp32 F.linear": (fp32, lambda w, x: lambda: F.linear(x, w)),
        "bf16 gpt2port": (bf16, lambda w, x: (lambda xb: lambda: torch.ops.gpt2port.matvec(xb, w, None))(
            x.bfloat16())),
        "bf16 F.linear": (bf16, lambda w, x: (lambda xb: lambda: F.linear(xb, w))(x.bfloat16())),
        "int8pack bf16": (int8, lambda qs, x: (lambda xb, s: lambda: torch._weight_int8pack_mm(xb, qs[0], s))(
            x.to(quant.ACTIVATION_DTYPE), qs[1].to(quant.ACTIVATION_DTYPE))),
    }
    if not native.kernels().matvec:
        del out["fp32 gpt2port"], out["bf16 gpt2port"]
    if quant._fbgemm_works():
        out["int8 fbgemm"] = (int8, lambda qs, x: (lambda p: lambda: torch.ops.quantized.linear_dynamic.default(
            x, p, quant._reduce_range()))(quant._pack(qs[0], qs[1], None)))
    rates = {}
    with torch.inference_mode():
        for name, (weights, make) in out.items():
            products = [make(w, xs[k]) for w, (_, k) in zip(weights, shapes)]
            nbytes = sum(n * k for n, k in shapes) * WEIGHT_BYTES[name.split()[0]]
            rates[name] = nbytes / seconds(products) / 1e9
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="gpt2", help="a GPT-2 size or alias (gpt2, gpt2-xl, 1.5B, ...)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    size = canonical_name(args.size)
    step = step_shapes(GPTConfig.preset(size))
    print(f"torch {torch.__version__}, {args.threads} threads, {size}; GB/s of weight streamed for one token")
    header = None
    rows = [(f"{n} x {k}", [(n, k)] * max(1, FP32_BYTES // (4 * n * k))) for n, k in [*dict.fromkeys(step), PROBE]]
    rows.append((f"{size} step, in order", step))
    for label, shapes in rows:
        rates = kernels(shapes)
        if header is None:
            header = list(rates)
            print(f"| {'weight (out, in)':<19} | " + " | ".join(header) + " |")
            print("|---|" + "---:|" * len(header))
        print(f"| {label:<19} | " + " | ".join(f"{rates[h]:.1f}" for h in header) + " |", flush=True)


if __name__ == "__main__":
    main()
