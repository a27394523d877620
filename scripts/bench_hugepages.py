"""What 2 MB pages for the int8 weights (gpt2port.hugepages) change in int8 decoding, measured in fresh processes.

Where glibc puts an allocation depends on what the process allocated and freed before, so a comparison inside one
process is skewed by whichever load ran first. Here each measurement is its own process, as `gpt2port generate`
is: it loads the int8 model with gpt2port.hugepages.ENABLED off or on, decodes greedily (a 16-token prompt, 128 new
tokens, five times) and reports its median ms per token and how much of its memory the kernel gave 2 MB pages. The
two settings alternate, pair after pair, so both see the same machine load; the summary is the mean over the pairs.
The baseline is the same model in 4 KB pages (ENABLED off), which is how it was allocated before that module.

Usage (from the repository root):
    python -m scripts.bench_hugepages CKPT [--pairs 9] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

RUNS = 5


def child(ckpt: str, enabled: bool, threads: int) -> None:
    import torch

    from gpt2port import GPT, hugepages
    from scripts.bench_generate import PROMPT_LEN, ours_decode

    torch.set_num_threads(threads)
    hugepages.ENABLED = enabled
    model = GPT.from_pretrained(ckpt, dtype="int8")
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    ms = [1e3 / ours_decode(model, prompt)[0] for _ in range(RUNS)]
    rollup = Path("/proc/self/smaps_rollup").read_text()
    huge_mb = int(re.search(r"AnonHugePages:\s+(\d+)", rollup).group(1)) // 1024
    print(json.dumps({"median_ms": statistics.median(ms), "huge_mb": huge_mb}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", help="a gpt2port checkpoint directory (e.g. from scripts/hf_fixtures.py + convert)")
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", choices=["off", "on"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.ckpt, args.child == "on", args.threads)
    got: dict[str, list[dict]] = {"off": [], "on": []}
    for pair in range(args.pairs):
        for setting in ("off", "on"):
            out = subprocess.run([sys.executable, "-m", "scripts.bench_hugepages", args.ckpt, "--child", setting,
                                  "--threads", str(args.threads)], stdout=subprocess.PIPE, text=True, check=True)
            got[setting].append(json.loads(out.stdout.strip().splitlines()[-1]))
        off, on = got["off"][-1], got["on"][-1]
        print(f"pair {pair + 1}: 4 KB pages {off['median_ms']:.2f} ms/token, 2 MB pages {on['median_ms']:.2f} "
              f"({on['median_ms'] / off['median_ms'] - 1:+.1%}; {on['huge_mb']} MB in 2 MB pages)", flush=True)
    mean = {k: statistics.mean(r["median_ms"] for r in v) for k, v in got.items()}
    changes = [b["median_ms"] / a["median_ms"] - 1 for a, b in zip(got["off"], got["on"])]
    print(f"mean over {args.pairs} pairs: 4 KB pages {mean['off']:.2f} ms/token, 2 MB pages {mean['on']:.2f} "
          f"({mean['on'] / mean['off'] - 1:+.1%}); pairs from {min(changes):+.1%} to {max(changes):+.1%}")


if __name__ == "__main__":
    main()
