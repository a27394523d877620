"""Decoding on a CUDA device, side by side in one run: gpt2port's step recorded as a CUDA graph
(Settings(cuda_graph=True): opt-in until this script has proved it) against its eager step, Hugging Face's eager
`generate`, and Hugging Face's own fast path, a static cache with the decoding forward compiled by torch.compile
(transformers compiles it itself when a generation uses a static cache on a GPU), at fp32 and bf16.

For each size: the random-weight checkpoint of scripts/bench/generate (`prepare`), loaded by both libraries from the
same files; greedy, a 16-token prompt, 128 new tokens, tokens/s including the prompt's prefill, the device
synchronized around each run. Every contender runs once first (for HF's compiled path that first run includes the
compilation: its time is reported apart, as start-up, never inside a rate); then the rounds alternate contender by
contender and the best run of each counts. The floor: bytes of weights per token / the GPU's one-row product
bandwidth measured in the same run (gpt2port.fast.speed.matvec_bandwidth: fp32 and bf16 against a 1 GB weight, 10
products per timing; its best).

Targets: 124M fp32 recorded >= 5x HF eager; 1.5B bf16 recorded >= 60% of the floor.

Usage (from the repository root, on a machine with a CUDA device):
    python -m scripts.bench.generate_cuda [--sizes gpt2,gpt2-xl] [--repeats 3] [--workdir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpt2port import GPT
from gpt2port.generate import generate
from gpt2port.fast.speed import matvec_bandwidth, weight_bytes_per_token
from scripts.bench.generate import FAST, GRAPHED, NEW_TOKENS, _common_prefix, hf_decode, ours_decode, prepare

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GRAPH, EAGER, HF_EAGER, HF_COMPILED = "gpt2port, CUDA graph", "gpt2port, eager step", "HF eager", \
    "HF static cache + compile"


def hf_model(hf_dir: Path, dtype: torch.dtype, static: bool):
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=dtype).to("cuda").eval()
    model.generation_config.eos_token_id = None  # all 128 tokens, as ours with stop_token=None
    if static:
        model.generation_config.cache_implementation = "static"
    return model


def bench(size: str, dtype_name: str, root: Path, repeats: int, bandwidth: float, compiled: bool = True) -> dict:
    dtype = DTYPES[dtype_name]
    hf_dir, ckpt = prepare(size, root)
    ours = GPT.from_pretrained(ckpt, dtype=dtype, device="cuda")
    hf, hf_static = hf_model(hf_dir, dtype, False), hf_model(hf_dir, dtype, True) if compiled else None
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 50257, (1, 16), generator=g).to("cuda")
    how: list[str] = []
    generate(ours, prompt.tolist(), 2, temperature=0, stop_token=None, fast=GRAPHED, report=how)
    if not how[0].startswith("the model's forward, recorded as a CUDA graph"):  # else the eager step, timed twice
        sys.exit(f"error: the decode step was not recorded as a CUDA graph: it ran on {how[0]}")
    contenders = {GRAPH: lambda: ours_decode(ours, prompt, GRAPHED), EAGER: lambda: ours_decode(ours, prompt, FAST),
                  HF_EAGER: lambda: hf_decode(hf, prompt)}
    if compiled:
        contenders[HF_COMPILED] = lambda: hf_decode(hf_static, prompt)
    startup = {}
    for name, decode in contenders.items():  # the first run: warm-up, and HF's compilation
        t = time.perf_counter()
        decode()
        startup[name] = time.perf_counter() - t
    rates, tokens = {name: [] for name in contenders}, {}
    for r in range(repeats):
        for name, decode in contenders.items():
            rate, tokens[name] = decode()
            rates[name].append(rate)
        print(f"[{size} {dtype_name}] run {r + 1}/{repeats}: " +
              ", ".join(f"{k} {v[-1]:.1f} tokens/s" for k, v in rates.items()), file=sys.stderr)
    best = {k: max(v) for k, v in rates.items()}
    per_token = weight_bytes_per_token(ours)
    result = {
        "size": size, "dtype": dtype_name, "device": torch.cuda.get_device_name(),
        "tokens_per_s": best, "all_runs": rates, "first_run_s": startup,
        "vs_hf_eager": {k: v / best[HF_EAGER] for k, v in best.items()},
        "floor_tokens_per_s": bandwidth / per_token,
        "fraction_of_floor": {k: v / (bandwidth / per_token) for k, v in best.items()},
        "greedy_equal_to_hf_eager": {k: _common_prefix(tokens[k], tokens[HF_EAGER]) for k in tokens},
    }
    ours = hf = hf_static = contenders = None  # free the GPU memory before the next size
    gc.collect()
    torch.cuda.empty_cache()
    return result


def report(r: dict) -> str:
    lines = [f"== {r['size']} {r['dtype']} on {r['device']} ==  greedy, 16-token prompt, {NEW_TOKENS} new tokens, "
             f"best of the runs; floor {r['floor_tokens_per_s']:.0f} tokens/s"]
    for k, rate in r["tokens_per_s"].items():
        lines.append(f"  {k:28s} {rate:8.1f} tokens/s  {r['vs_hf_eager'][k]:5.2f}x HF eager  "
                     f"{r['fraction_of_floor'][k]:6.1%} of the floor  first run {r['first_run_s'][k]:6.2f} s  "
                     f"greedy = HF eager's for {r['greedy_equal_to_hf_eager'][k]}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="gpt2,gpt2-xl")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--workdir", type=Path, default=None, help="keep the random checkpoints here for reuse")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-compile", action="store_true", help="leave out HF's static cache + torch.compile (minutes)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_generate_cuda: no CUDA device here")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(args.threads)
    bandwidth = matvec_bandwidth("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, one-row product bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-generate-cuda-") as tmp:
        root = args.workdir or Path(tmp)
        for size in args.sizes.split(","):
            for dtype_name in args.dtypes.split(","):
                results.append(bench(size.strip(), dtype_name.strip(), root, args.repeats, bandwidth,
                                     not args.no_compile))
                print(report(results[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"bandwidth_bytes_per_s": bandwidth, "torch": torch.__version__,
                                         "results": results}, indent=2))


if __name__ == "__main__":
    main()
