"""What the compiled decode step (Settings(compile=True), GPT2PORT_COMPILE=1: torch.export and AOTInductor,
gpt2port/fast/package.py) costs before its first token: the first compile of a model shape, with gpt2port's cache of
compiled steps and Inductor's own cache empty, and a cached start, a new process finding the package there. Each in a
fresh interpreter: load the checkpoint, then generate 4 tokens greedily from a 4-token prompt, once with the step
compiled and once as it is (the default); the difference is the compile.

Usage (from the repository root; any gpt2port checkpoint directory):
    python -m scripts.bench.compile_start --ckpt DIR [--dtypes fp32,bf16] [--threads 2] [--starts 2]
Both caches are a temporary directory (GPT2PORT_NATIVE_CACHE, TORCHINDUCTOR_CACHE_DIR), emptied before the first
start only; gpt2port's C kernels are built there first, outside the timing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(ckpt: str, dtype: str, threads: int) -> dict:
    import torch

    from gpt2port import GPT
    from gpt2port.fast import Settings
    from gpt2port.generate import generate

    torch.set_num_threads(threads)
    model = GPT.from_pretrained(ckpt, dtype={"fp32": None, "bf16": torch.bfloat16}[dtype])
    got = {}
    for name, settings in (("as it is", Settings()), ("compiled", Settings(compile=True))):
        report: list[str] = []
        t, cpu = time.perf_counter(), time.process_time()
        generate(model, [[1, 2, 3, 4]], 4, temperature=0, stop_token=None, fast=settings, report=report)
        got[name] = {"s": time.perf_counter() - t, "cpu_s": time.process_time() - cpu, "how": report[-1]}
    got["load_average"] = os.getloadavg()[0]
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--starts", type=int, default=2, help="processes per dtype: the first compiles, the rest cached")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.ckpt, args.child, args.threads)))
        return
    for dtype in args.dtypes.split(","):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(cache) / "inductor"),
                       GPT2PORT_NATIVE_CACHE=str(Path(cache) / "native"))
            subprocess.run([sys.executable, "-c", "from gpt2port.fast import native; native.kernels()"], env=env,
                           check=True)
            for start in range(args.starts):
                out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--ckpt", args.ckpt, "--child",
                                      dtype, "--threads", str(args.threads)], env=env, stdout=subprocess.PIPE,
                                     text=True, check=True)
                got = json.loads(out.stdout.strip().splitlines()[-1])
                extra = got["compiled"]["s"] - got["as it is"]["s"]
                print(f"{dtype} start {start + 1} ({'first compile' if start == 0 else 'cached'}): "
                      f"compiled {got['compiled']['s']:.1f} s ({got['compiled']['cpu_s']:.1f} s CPU) against "
                      f"{got['as it is']['s']:.1f} s as it is: {extra:.1f} s more; load {got['load_average']:.1f}; "
                      f"{got['compiled']['how']}", flush=True)


if __name__ == "__main__":
    main()
