"""`gpt2port eval` against lm-evaluation-harness, side by side on the same CPU, model and files, each contender in
turn, round by round (this machine is shared: its speed swings from minute to minute, so the load average is
printed beside every run, the best of the rounds is kept, and the CPU time each used is printed beside its wall
time).

The model: GPT-2 124M's shapes with realistic-scale random weights (tests/realistic.py), as a Hugging Face directory
(what the harness loads) and its gpt2port conversion. The files: LAMBADA- and HellaSwag-layout jsonl made of the
license text the OS or Python ships (scripts/eval_data.py). Each contender's time includes loading the model, as a
user waits for it; the figures of both are printed, and must agree.

Usage (from the repository root; needs `pip install lm-eval accelerate`):
    python -m scripts.bench.eval [--size gpt2] [--lambada 200] [--hellaswag 50] [--rounds 2] [--threads 1]
        [--tasks lambada_openai,hellaswag]
        [--harness-batch 16] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from gpt2port.evaluation.run import run_eval
from scripts import eval_data
from scripts.bench import scratch_root


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="gpt2")
    ap.add_argument("--lambada", type=int, default=200, help="LAMBADA examples")
    ap.add_argument("--hellaswag", type=int, default=50, help="HellaSwag examples")
    ap.add_argument("--tasks", default="lambada_openai,hellaswag")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, both contenders (1: least disturbed "
                    "by other work on a shared machine)")
    ap.add_argument("--harness-batch", type=int, default=16)
    ap.add_argument("--workdir", type=Path, default=None, help="keep the model and files here for reuse")
    args = ap.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(args.threads)
    from tests.realistic import realistic_checkpoint

    root = args.workdir or scratch_root("bench-eval-")
    hf_dir, ckpt = root / "hf", root / "ckpt"
    if not (ckpt / "model.safetensors").is_file():
        hf_dir, ckpt = realistic_checkpoint(root, args.size, seed=0)
    text = eval_data.english()
    lambada = eval_data.sentences(text)[: args.lambada]
    files = {"lambada_openai": eval_data.write_lambada(root / "lambada.jsonl", lambada),
             "hellaswag": eval_data.write_hellaswag(root / "hellaswag.jsonl", text, args.hellaswag)}
    ours_task = {"lambada_openai": "lambada", "hellaswag": "hellaswag"}
    keys = {"lambada_openai": ("accuracy", "acc", "perplexity", "perplexity"),
            "hellaswag": ("acc", "acc", "acc_norm", "acc_norm")}
    print(f"{args.size}, {args.threads} threads, torch {torch.__version__}, {os.cpu_count()} cores; "
          f"load average (1/5/15 min) at start {_load()}")
    for task in args.tasks.split(","):
        path = files[task]
        best = {"gpt2port": [float("inf")] * 2, "harness": [float("inf")] * 2}  # [wall, CPU] seconds
        for r in range(args.rounds):
            t, c = time.perf_counter(), time.process_time()
            ours = run_eval(str(ckpt), ours_task[task], str(path))
            _keep(best["gpt2port"], t, c)
            print(f"  round {r} {task} gpt2port {time.perf_counter() - t:6.1f} s (CPU {time.process_time() - c:5.1f})"
                  f"  load {_load()}  "
                  f"{keys[task][0]} {ours[keys[task][0]]:.6g} {keys[task][2]} {ours[keys[task][2]]:.6g}")
            t, c = time.perf_counter(), time.process_time()
            theirs = eval_data.run_harness(hf_dir, task, path, root, args.harness_batch)
            _keep(best["harness"], t, c)
            print(f"  round {r} {task} harness  {time.perf_counter() - t:6.1f} s (CPU {time.process_time() - c:5.1f})"
                  f"  load {_load()}  "
                  f"{keys[task][1]} {theirs[keys[task][1]]:.6g} {keys[task][3]} {theirs[keys[task][3]]:.6g}")
        (ours_wall, ours_cpu), (their_wall, their_cpu) = best["gpt2port"], best["harness"]
        print(f"{task} ({ours['examples']} examples, harness batch {args.harness_batch}): best wall gpt2port "
              f"{ours_wall:.1f} s, harness {their_wall:.1f} s: {their_wall / ours_wall:.2f}x; best CPU time "
              f"{ours_cpu:.1f} s, {their_cpu:.1f} s: {their_cpu / ours_cpu:.2f}x")


def _keep(best: list[float], t: float, c: float) -> None:
    """The least wall and CPU time so far (CPU time: the process's, every thread's; on a shared machine it
    moves less than wall time with the other work)."""
    best[0] = min(best[0], time.perf_counter() - t)
    best[1] = min(best[1], time.process_time() - c)


if __name__ == "__main__":
    main()
