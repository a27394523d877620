"""Decode speed of two checkouts of gpt2port side by side: the same checkpoint, the same machine, runs alternating.

For each thread count and round, each tree in turn runs a fresh interpreter (PYTHONPATH set to that tree) that
loads the checkpoint as fp32, bf16 and int8 and, for each, decodes greedily from a 16-token prompt (after a short
warm-up), timing 128 new tokens, the prompt's prefill included (as scripts/bench/generate.py). Right before each
decode it probes the memory bandwidth (the tree's own matvec_bandwidth), so each rate is also given as a fraction of
the floor that probe sets: bandwidth / bytes of weights per token (the table gives the first of --dtypes'). Trees
alternate round by round, so both see the same load; on a shared machine compare ranges, not single runs.

Usage (from the repository root; any gpt2port checkpoint directory, e.g. one scripts/bench/generate.py --workdir
left, or a small one, where a step is all dispatch and Python):
    python -m scripts.bench.side_by_side --trees /path/to/before,. --ckpt DIR [--threads 1,2] [--rounds 3]
                                         [--dtypes fp32,bf16,int8] [--tokens 128] [--json out.json]
A tree may carry environment variables for its runs, `TREE:NAME=VALUE[:NAME=VALUE]` (`.:GPT2PORT_COMPILE=1`: the
same tree with the step compiled, its compile in the warm-up, outside the timing).
The child only uses what both trees have: GPT.from_pretrained, gpt2port.generate.steps and the bandwidth probe.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT_LEN, NEW_TOKENS, DTYPES = 16, 128, ("fp32", "bf16", "int8")


def child(ckpt: str, threads: int, dtypes: list[str], new_tokens: int) -> dict:
    import torch

    import gpt2port
    from gpt2port import GPT
    from gpt2port.generate import steps
    if (Path(gpt2port.__file__).parent / "fast" / "speed.py").exists():
        from gpt2port.fast.speed import matvec_bandwidth, weight_bytes_per_token
    else:  # a tree from before gpt2port.fast
        from gpt2port.speed import matvec_bandwidth, weight_bytes_per_token

    torch.set_num_threads(threads)
    got = {}
    for name in dtypes:
        dtype = {"fp32": None, "bf16": torch.bfloat16, "int8": "int8"}[name]
        model = GPT.from_pretrained(ckpt, dtype=dtype)
        prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
        for _ in steps(model, prompt[:, :4], max_new_tokens=8, temperature=0, stop_token=None):
            pass
        bandwidth = matvec_bandwidth("cpu", repeats=5)
        times, cpu, report = [time.perf_counter()], time.process_time(), []
        for _ in steps(model, prompt, max_new_tokens=new_tokens, temperature=0, stop_token=None, report=report):
            times.append(time.perf_counter())
        cpu = time.process_time() - cpu
        rate = new_tokens / (times[-1] - times[0])
        gaps = sorted(b - a for a, b in zip(times[1:], times[2:]))  # one decode step each (the prefill is the first)
        got[name] = {"tokens_per_s": rate, "bandwidth": bandwidth,
                     "floor_fraction": rate * weight_bytes_per_token(model) / bandwidth,
                     "step_ms_median": 1e3 * statistics.median(gaps),
                     "step_ms_best_decile": 1e3 * gaps[len(gaps) // 10], "how": report[-1] if report else "",
                     "load_average": os.getloadavg()[0],  # the 1-minute load right after the run: a shared machine
                     # CPU time the process spent per token: what a busy machine's waiting for a core leaves out
                     # (at --threads 1; cache and memory contention still count)
                     "cpu_ms_per_token": 1e3 * cpu / new_tokens}
        del model
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", help="comma-separated checkout directories (the first is the baseline)")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--threads", default="2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated, of " + ",".join(DTYPES))
    ap.add_argument("--tokens", type=int, default=NEW_TOKENS, help="new tokens timed per decode")
    ap.add_argument("--json")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)  # threads, in a child
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    if set(dtypes) - set(DTYPES) or args.tokens < 2:
        ap.error(f"--dtypes: of {','.join(DTYPES)}; --tokens: at least 2")
    if args.child:
        print(json.dumps(child(args.ckpt, args.child, dtypes, args.tokens)))
        return
    trees = args.trees.split(",")
    runs: dict = {}
    for threads in (int(t) for t in args.threads.split(",")):
        for r in range(args.rounds):
            for spec in trees:
                tree, *variables = spec.split(":")
                tree = Path(tree).resolve()
                env = dict(os.environ, PYTHONPATH=str(tree), **dict(v.split("=", 1) for v in variables))
                out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--ckpt", args.ckpt,
                                      "--child", str(threads), "--dtypes", args.dtypes, "--tokens",
                                      str(args.tokens)], cwd=tree, env=env, stdout=subprocess.PIPE, text=True,
                                     check=True)
                got = json.loads(out.stdout.strip().splitlines()[-1])
                name = ":".join([tree.name, *variables])
                runs.setdefault(f"{threads}", {}).setdefault(name, []).append(got)
                print(f"threads {threads} round {r + 1} {name}: " + ", ".join(
                    f"{k} {v['tokens_per_s']:.1f} tok/s ({v['floor_fraction']:.0%} of floor; step median "
                    f"{v['step_ms_median']:.2f} ms, best decile {v['step_ms_best_decile']:.2f} ms; CPU "
                    f"{v['cpu_ms_per_token']:.2f} ms/token; load {v['load_average']:.1f})"
                    for k, v in got.items()),
                    file=sys.stderr, flush=True)
    print(report(runs, dtypes))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


def report(runs: dict, dtypes: list[str]) -> str:
    lines = ["| threads | tree | " + " | ".join(f"{d} tokens/s (median, min-max)" for d in dtypes)
             + " | fraction of floor (median, min-max) | " + " | ".join(f"{d} CPU ms/token" for d in dtypes)
             + " | load average (min-max) |", "|---" * (4 + 2 * len(dtypes)) + "|"]
    for threads, trees in runs.items():
        for tree, rounds in trees.items():
            cells = []
            for d in dtypes:
                rates = [r[d]["tokens_per_s"] for r in rounds]
                cells.append(f"{statistics.median(rates):.1f} ({min(rates):.1f}-{max(rates):.1f})")
            fractions = [r[dtypes[0]]["floor_fraction"] for r in rounds]  # the first dtype's
            cells.append(f"{statistics.median(fractions):.0%} ({min(fractions):.0%}-{max(fractions):.0%})")
            for d in dtypes:
                cpu = [r[d]["cpu_ms_per_token"] for r in rounds]
                cells.append(f"{statistics.median(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f})")
            loads = [r[d]["load_average"] for r in rounds for d in dtypes]
            cells.append(f"{min(loads):.1f}-{max(loads):.1f}")
            lines.append(f"| {threads} | {tree} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
