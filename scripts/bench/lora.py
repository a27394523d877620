"""Benchmark: one LoRA training step of gpt2port against full fine-tuning, and against peft + transformers on the
same loop and batch: peak RSS and steps/s, side by side in one run.

Contenders (random weights at --size, the same batch of --batch-size x --block-size tokens per step, fp32, CPU):
  full   gpt2port's GPT, every weight trained: the step `gpt2port finetune` runs (training/loop.py's Trainer.step)
  lora   the same step on the same model with gpt2port's LoRA attached (rank --rank on --targets, base frozen):
         what `gpt2port finetune --lora` runs
  lora-bf16  the same, the frozen base's matrices held in bf16 (computed in fp32): `finetune --lora-base-dtype bf16`
  KIND-ckpt, KIND-ckptN  any of the three above with activation checkpointing: every block's activations (or the
         first N blocks') recomputed in the backward, `finetune --checkpoint-activations [N]` (training/recompute.py)
  peft   transformers' GPT2LMHeadModel (sdpa attention) with peft's LoRA of the same rank on the same matrices,
         trained by the same loop written by hand (cross-entropy on every position, clipping, AdamW with gpt2port's
         parameter groups)
  peft-ckpt  the same with transformers' activation checkpointing (activation_checkpointing_enable), peft's way to
         fit a larger model: each block's activations recomputed in the backward
Each contender runs in a process of its own (so VmHWM, the peak RSS, is its own: model, activations, gradients,
optimizer state, torch itself), --warmup steps then --steps timed (wall time, and the process's CPU time, which
other jobs on a shared machine disturb less); the processes take turns for --rounds rounds
so that all see the machine in the same state. The load average is printed before and after.

    python -m scripts.bench.lora [--size gpt2] [--rank 8] [--targets qkv] [--batch-size 4] [--block-size 256]
                                 [--steps 4] [--warmup 1] [--rounds 2] [--threads 2]
                                 [--kinds full,lora,lora-bf16,peft,peft-ckpt,lora-ckpt,lora-ckpt16,...]
    python -m scripts.bench.lora --block --size gpt2-xl --threads 1 --kinds lora,lora-bf16,peft,lora-ckpt,peft-ckpt
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from scripts import ROOT
from scripts.bench.finetune import _gpt2port_step, _transformers_step

HF_NAMES = {"qkv": "attn.c_attn", "attn_proj": "attn.c_proj", "fc": "mlp.c_fc", "mlp_proj": "mlp.c_proj"}


def _peak_rss_gb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1e6


def _tokens(config):
    import numpy as np

    return np.random.default_rng(0).integers(0, config.vocab_size, size=200_000).astype(np.uint16)


def _gpt2port(config, args, kind: str):
    from gpt2port.lora import held, layer
    from gpt2port.lora.spec import Spec
    from gpt2port.training import recompute

    base, ckpt, blocks = kind.partition("-ckpt")

    def attach(model):
        if base != "full":
            layer.attach(model, Spec(args.rank, 2.0 * args.rank, tuple(args.targets.split(","))),
                         torch.Generator().manual_seed(0))
        if base == "lora-bf16":
            held.hold_(model)
        if ckpt:
            recompute.attach(model, int(blocks) if blocks else config.n_layer)

    if base not in ("full", "lora", "lora-bf16"):
        sys.exit(f"--kinds: unknown contender {kind}")
    return _gpt2port_step(config, torch.device("cpu"), args, _tokens(config), None, attach)


def _peft(config, args, checkpointing: bool):
    import peft

    lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, fan_in_fan_out=True, lora_dropout=0.0,
                           target_modules=[HF_NAMES[t] for t in args.targets.split(",")])

    def wrap(model):
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
        return peft.get_peft_model(model, lora)

    return _transformers_step(config, torch.device("cpu"), args, _tokens(config), None, wrap)


def worker(args) -> None:
    """One contender in this process: its step times and peak RSS as one JSON line."""
    from gpt2port.config import GPTConfig

    torch.set_num_threads(args.threads)
    args.compile = False  # what scripts/bench/finetune.py's steps read
    config = GPTConfig(**json.loads(args.size)) if args.size.startswith("{") else GPTConfig.preset(args.size)
    kind = args.worker
    model, step = _peft(config, args, kind == "peft-ckpt") if kind.startswith("peft") else _gpt2port(config, args, kind)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    times, cpu, losses = [], [], []
    for i in range(args.warmup + args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step(i))
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    print(json.dumps({"times": times, "cpu": cpu, "peak_rss_gb": _peak_rss_gb(), "trained": trained,
                      "first_loss": losses[0]}))


def block(args, config) -> None:
    """--block: one block of each contender at --size's width and --batch-size x --block-size, its forward and its
    backward (to its input, as inside the model) timed apart in CPU time on --threads, best of --steps after
    --warmup: where a step's time goes, the head and the optimizer left out."""
    import dataclasses

    torch.set_num_threads(args.threads)
    args.compile = False
    one = dataclasses.replace(config, n_layer=1)
    x0 = torch.randn(args.batch_size, args.block_size, config.n_embd, generator=torch.Generator().manual_seed(0))
    print(f"one block at {args.size}'s width, batch {args.batch_size} x {args.block_size}, rank {args.rank} on "
          f"{args.targets}, {args.threads} thread(s), CPU time, best of {args.steps} after {args.warmup}")
    print("| contender | forward (s) | backward (s) | both (s) |")
    print("|---|---:|---:|---:|")
    for kind in args.kinds.split(","):
        if kind.startswith("peft"):
            model, _ = _peft(one, args, kind == "peft-ckpt")
            blk = model.base_model.model.transformer.h[0]
        else:
            model, _ = _gpt2port(one, args, kind)
            blk = model.blocks[0]
        model.train()
        fw, bw = [], []
        for i in range(args.warmup + args.steps):
            x = x0.clone().requires_grad_(True)
            c0 = time.process_time()
            y = blk(x)
            y = y[0] if isinstance(y, tuple) else y
            c1 = time.process_time()
            y.sum().backward()
            if i >= args.warmup:
                fw.append(c1 - c0)
                bw.append(time.process_time() - c1)
        print(f"| {kind} | {min(fw):.3f} | {min(bw):.3f} | {min(f + b for f, b in zip(fw, bw)):.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="gpt2", help="a preset name, or GPTConfig's fields as JSON (a quick check)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="qkv")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kinds", default="full,lora,peft")
    ap.add_argument("--block", action="store_true", help="time one block of each contender instead (block())")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.block:
        from gpt2port.config import GPTConfig

        return block(args, GPTConfig(**json.loads(args.size)) if args.size.startswith("{") else
                     GPTConfig.preset(args.size))
    kinds = args.kinds.split(",")
    results = {k: {"times": [], "cpu": [], "peak_rss_gb": 0.0} for k in kinds}
    load_before = os.getloadavg()
    passed = [a for a in sys.argv[1:]]
    for r in range(args.rounds):
        for kind in kinds[r % len(kinds):] + kinds[: r % len(kinds)]:  # a different one goes first each round
            out = subprocess.run([sys.executable, "-m", "scripts.bench.lora", *passed, "--worker", kind],
                                 cwd=ROOT, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{kind} failed:\n{out.stderr}")
            got = json.loads(out.stdout.strip().splitlines()[-1])
            results[kind]["times"] += got["times"]
            results[kind]["cpu"] += got["cpu"]
            results[kind]["peak_rss_gb"] = max(results[kind]["peak_rss_gb"], got["peak_rss_gb"])
            results[kind]["trained"] = got["trained"]
            print(f"round {r + 1} {kind}: median step {statistics.median(got['times']):.2f} s (CPU time "
                  f"{statistics.median(got['cpu']):.2f} s), peak RSS "
                  f"{got['peak_rss_gb']:.2f} GB", file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    print(f"{args.size}, batch {args.batch_size} x {args.block_size}, rank {args.rank} on {args.targets}, fp32, "
          f"{args.threads} threads, torch {torch.__version__}; {args.rounds} rounds of {args.steps} steps after "
          f"{args.warmup}; load average before {load_before[0]:.1f}, after {load_after[0]:.1f} "
          f"({os.cpu_count()} cores)")
    print("| contender | trained parameters | median step (s) | steps/s | CPU time per step (s) | peak RSS (GB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, r in results.items():
        med = statistics.median(r["times"])
        print(f"| {kind} | {r['trained']:,} | {med:.2f} | {1 / med:.3f} | {statistics.median(r['cpu']):.1f} | "
              f"{r['peak_rss_gb']:.2f} |")
    for ours in [k for k in kinds if not k.startswith("peft") and k != "full"]:
        for other in ("full", "peft", "peft-ckpt"):
            if other in results:
                mine, theirs = results[ours], results[other]
                speed = statistics.median(theirs["times"]) / statistics.median(mine["times"])
                work = statistics.median(theirs["cpu"]) / statistics.median(mine["cpu"])
                print(f"{ours} vs {other}: {speed:.2f}x the steps/s ({work:.2f}x by CPU time), "
                      f"{mine['peak_rss_gb'] / theirs['peak_rss_gb']:.2f}x the peak RSS")


if __name__ == "__main__":
    main()
