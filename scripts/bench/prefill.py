"""Prefill of one long prompt, the part of generating that a long prompt is mostly made of: one forward over the
prompt that fills the KV cache and gives the next token's logits, side by side, each contender in turn, round by
round (this machine's speed swings from minute to minute: neighbours see the same), best of the rounds.

Contenders, on the same random weights (scripts.bench.generate.prepare): gpt2port fp32, bf16 and int8 (its many-row
products on the weight dequantized a block at a time and multiplied on oneDNN, gpt2port/quant.py), int8 with those
blocks on F.linear (MKL; gpt2port.fast.Settings(onednn=False)), HF GPT2LMHeadModel fp32
(use_cache=True, logits for the last position only, as every contender computes them), and, where llama-cpp-python
is installed, llama.cpp on the same weights exported as q8_0 GGUF (its context reset first, so that nothing of the
previous round's prompt is reused).

Usage (from the repository root):
    python -m scripts.bench.prefill [--size gpt2] [--tokens 880] [--rounds 4] [--threads 2] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from gpt2port import GPT
from gpt2port.fast import Settings
from gpt2port.fast.kernels import accelerated
from gpt2port.model import KVCache
from scripts.bench import llama_contender, scratch_root
from scripts.bench.generate import prepare


def ours(model: GPT, ids: torch.Tensor, settings: Settings = Settings()) -> float:
    """One prefill with gpt2port.fast's layers swapped in, as generate runs it."""
    with torch.inference_mode(), accelerated(model, settings):
        cache = KVCache(model.config, 1, ids.size(1) + 1, model.pos_emb.weight.dtype)  # as generate makes it
        t = time.perf_counter()
        model(ids, cache=cache, logits_to_keep=1)
        return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="gpt2")
    ap.add_argument("--tokens", type=int, default=880)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--workdir", type=Path, default=None, help="keep the random checkpoints here for reuse")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(args.threads)
    from transformers import GPT2LMHeadModel

    root = args.workdir or scratch_root("bench-prefill-")
    hf_dir, ckpt = prepare(args.size, root)
    ids = torch.randint(0, 50257, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    fp32, bf16 = GPT.from_pretrained(ckpt), GPT.from_pretrained(ckpt, dtype="bf16")
    int8 = GPT.from_pretrained(ckpt, dtype="int8")
    hf = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def hf_prefill() -> float:
        with torch.inference_mode():
            t = time.perf_counter()
            hf(ids, use_cache=True, logits_to_keep=1)  # the last position's logits, as its generate prefills
            return time.perf_counter() - t

    contenders = {"gpt2port fp32": lambda: ours(fp32, ids), "gpt2port bf16": lambda: ours(bf16, ids),
                  "gpt2port int8": lambda: ours(int8, ids),
                  "gpt2port int8, blocks on F.linear": lambda: ours(int8, ids, Settings(onednn=False)),
                  "HF fp32": hf_prefill}
    llama = llama_contender.q8_0_model(ckpt, root / f"{args.size}-q8_0", args.tokens + 8)
    if llama is not None:
        llm = llama[0]

        def llama_prefill() -> float:
            llm.reset()
            t = time.perf_counter()
            llm.eval(ids[0].tolist())
            return time.perf_counter() - t

        contenders["llama.cpp q8_0"] = llama_prefill
    else:
        print("llama-cpp-python is not installed: no llama.cpp contender")
    for run in contenders.values():  # warm-up: first calls, lazy builds, the weights' first touch
        run()
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(args.rounds):
        for name, run in contenders.items():
            seconds[name].append(run())
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in seconds.items()))
    print(f"== {args.size}: prefill of a {args.tokens}-token prompt, torch {torch.__version__}, {args.threads} "
          f"threads (best of {args.rounds} rounds) ==")
    best = {name: min(v) for name, v in seconds.items()}
    for name, s in best.items():
        print(f"  {name:36s} {s:7.3f} s   {args.tokens / s:8.1f} tokens/s   {best['HF fp32'] / s:5.2f}x HF")


if __name__ == "__main__":
    main()
