"""Benchmark: one fine-tuning step of gpt2port against the same loop on transformers' GPT2LMHeadModel, and the
memory one process holds when training with --fsdp on 2 processes against 1.

(1) Training speed, at --size (default gpt2, 124M; random weights, same for both). Each step: a batch of
    --batch-size sequences of --block-size tokens, forward, cross-entropy on all positions, backward, gradient
    clipping, AdamW (gpt2port's parameter groups, on both models), zero_grad. gpt2port's step is the one
    `gpt2port finetune` runs (training/loop.py's Trainer.step); transformers' the same written by hand. The two
    alternate, one step each, for --steps steps after --warmup steps each; tokens/s from the median step time.
    fp32 on CPU; on CUDA bf16 autocast, and with --compile both models go through torch.compile.
(2) With --fsdp-memory: `gpt2port finetune` on a random --size checkpoint, in 1 process and under torchrun with 2
    processes and --fsdp, a few steps each; peak RSS (VmHWM) of every training process.

    python -m scripts.bench.finetune [--size gpt2] [--batch-size 4] [--block-size 256] [--steps 10]
                                     [--device cpu|cuda] [--compile] [--fsdp-memory] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from scripts import ROOT


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _gpt2port_step(config, device, args, tokens, autocast, wrap=None):
    """(model, step(i) -> loss); wrap(model) changes the model before the optimizer is made (scripts/bench/lora.py)."""
    from gpt2port.model import GPT
    from gpt2port.training.dist import Runtime
    from gpt2port.training.loop import Log, Plan, Trainer
    from gpt2port.training.optim import adamw

    torch.manual_seed(0)
    model = GPT(config).to(device)
    if wrap is not None:
        wrap(model)
    runner = torch.compile(model) if args.compile else model
    plan = Plan(steps=10**6, batch_size=args.batch_size, block_size=args.block_size, lr=1e-4, min_lr=1e-5,
                warmup=0, weight_decay=0.1, clip=1.0, seed=0, eval_windows=1, autocast=autocast)
    rt = Runtime(rank=0, world=1, local_rank=0, device=device, sharded=False)
    trainer = Trainer(runner, adamw(model, 1e-4, 0.1), rt, plan, tokens, tokens, Log(Path(os.devnull), False, 0),
                      lambda row: None)
    return model, lambda i: trainer.step(i)["loss"]


def _transformers_step(config, device, args, tokens, autocast, wrap=None):
    """(model, step(i) -> loss); wrap(model) returns the model to train (scripts/bench/lora.py: peft's)."""
    import contextlib

    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt2port.training import data
    from gpt2port.training.optim import adamw, lr_at, set_lr

    torch.manual_seed(0)
    hf_config = GPT2Config(**config.to_hf_config())
    hf_config.resid_pdrop = hf_config.embd_pdrop = hf_config.attn_pdrop = 0.0
    hf_config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(hf_config).to(device).train()
    if wrap is not None:
        model = wrap(model).train()
    runner = torch.compile(model) if args.compile else model
    opt = adamw(model, 1e-4, 0.1)
    params = [p for p in model.parameters() if p.requires_grad]

    def step(i: int) -> float:
        set_lr(opt, lr_at(i, lr=1e-4, warmup=0, steps=10**6, min_lr=1e-5))
        offsets = data.sample_offsets(len(tokens), args.block_size, seed=0, step=i, count=args.batch_size)
        x, y = (t.to(device) for t in data.windows(tokens, offsets, args.block_size))
        with torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext():
            logits = runner(x).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return model, step


def speed(args) -> dict:
    import numpy as np

    from gpt2port.config import GPTConfig

    device = torch.device(args.device)
    config = GPTConfig.preset(args.size)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, size=200_000).astype(np.uint16)
    steps = {"gpt2port": _gpt2port_step(config, device, args, tokens, autocast)[1],
             "transformers": _transformers_step(config, device, args, tokens, autocast)[1]}
    times = {k: [] for k in steps}
    losses = {k: [] for k in steps}
    for i in range(args.warmup + args.steps):
        for name, step in steps.items():  # alternating: both see the same machine state, step for step
            _sync(device)
            t0 = time.perf_counter()
            losses[name].append(step(i))
            _sync(device)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    per_step = args.batch_size * args.block_size
    out = {name: {"median_step_s": statistics.median(t), "tokens_per_s": per_step / statistics.median(t),
                  "first_loss": losses[name][0]} for name, t in times.items()}
    out["ratio"] = out["gpt2port"]["tokens_per_s"] / out["transformers"]["tokens_per_s"]
    return out


def fsdp_memory(args) -> dict:
    """Peak RSS per training process: 1 process, then 2 processes with --fsdp (torchrun), same run."""
    work = args.workdir / args.size
    hf, ckpt, text = work / "hf", work / "ckpt", work / "text.txt"
    if not (ckpt / "model.safetensors").exists():
        subprocess.run([sys.executable, "-m", "scripts.hf_fixtures", str(hf), "--size", args.size, "--streamed"],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        subprocess.run([sys.executable, "-m", "gpt2port", "convert", str(hf), "--out", str(ckpt), "-q"],
                       cwd=ROOT, check=True)
        shutil.rmtree(hf)
    if not text.exists():
        text.write_text((ROOT / "README.md").read_text() * 20)
    results = {}
    for label, launcher in (("1 process", [sys.executable, "-m", "scripts.bench.finetune", "--worker"]),
                            ("2 processes, --fsdp", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     "--nproc-per-node", "2", "-m", "scripts.bench.finetune",
                                                     "--fsdp", "--worker"])):
        out = work / "run"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [*launcher, str(ckpt), str(text), str(out), str(args.batch_size), str(args.block_size)]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if r.returncode:
            raise SystemExit(r.stderr[-3000:])
        ranks = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
        results[label] = sorted(ranks, key=lambda x: x["rank"])
    shutil.rmtree(work / "run", ignore_errors=True)
    return results


def _worker(ckpt, text, out, batch_size, block_size, fsdp) -> None:
    from scripts.bench.convert import _vm_hwm_kib

    from gpt2port.training.finetune import Settings, finetune

    s = Settings(steps=3, batch_size=int(batch_size), block_size=int(block_size), eval_every=0, save_every=0,
                 warmup=1)
    finetune(ckpt, text, out, s, device="cpu", fsdp=fsdp, quiet=True)
    print(json.dumps({"rank": int(os.environ.get("RANK", "0")), "peak_rss_gb": _vm_hwm_kib() * 1024 / 1e9}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="gpt2")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--fsdp-memory", action="store_true")
    ap.add_argument("--skip-speed", action="store_true", help="with --fsdp-memory: measure memory only")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gpt2port-bench-finetune"))
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--fsdp", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _worker(*args.worker, fsdp=args.fsdp)
    where = f"{args.device}, {os.cpu_count()} cores, torch {torch.__version__}" + (", compiled" if args.compile else "")
    r = None if args.skip_speed else speed(args)
    if r is not None:
        _print_speed(args, r, where)
    if args.fsdp_memory:
        m = fsdp_memory(args)
        print(f"\n## peak RSS per training process, gpt2port finetune {args.size}, 3 steps (CPU, gloo)\n")
        print("| run | rank | peak RSS (GB) |")
        print("|---|---:|---:|")
        for label, ranks in m.items():
            for x in ranks:
                print(f"| {label} | {x['rank']} | {x['peak_rss_gb']:.2f} |")
        print(json.dumps(m), file=sys.stderr)


def _print_speed(args, r: dict, where: str) -> None:
    print(f"\n## one training step, {args.size}, batch {args.batch_size} x {args.block_size} tokens ({where})\n")
    print("| model | median step (s) | tokens/s | loss at step 0 |")
    print("|---|---:|---:|---:|")
    for name in ("gpt2port", "transformers"):
        print(f"| {name} | {r[name]['median_step_s']:.3f} | {r[name]['tokens_per_s']:,.0f} | "
              f"{r[name]['first_loss']:.4f} |")
    print(f"\ngpt2port / transformers tokens/s: {r['ratio']:.2f}x (goal >= 1.0)")
    print(json.dumps(r), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
