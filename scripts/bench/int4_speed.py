"""gpt2port's int4 against llama.cpp's Q4_K_M on the same weights and threads: decode tokens/s, the prefill of a
512-token prompt, and peak RSS.

Each contender runs in a process of its own (so that its peak RSS is its own), the two alternating round by round:

  gpt2port int4     `generate --dtype int4`'s path: the checkpoint quantized at load (gpt2port.fast.int4), the fast
                    layers swapped in, greedy decoding through gpt2port.generate.steps (the model's forward)
  --compiled        also int4 with the decode step compiled ahead of time (GPT2PORT_COMPILE=1's path, compiled or
                    loaded in the warm-up); how each int4 contender's steps ran is printed, and a compiled one whose
                    steps were declined fails rather than be timed as the forward under that name
  --wide BITS       int4 as above with its q/k/v and head at BITS-bit codes (the recipe's other choices, side by side)
  llama.cpp Q4_K_M  the same checkpoint exported as f32 GGUF by gpt2port and quantized by llama.cpp's own
                    llama_model_quantize (llama-cpp-python), greedy through llama.cpp's sampler

Decode: a 16-token prompt, 128 new tokens, the prompt's prefill included (as scripts/bench/generate.py measures), the
best of --repeats runs. Prefill: 512 random tokens in one forward (llama.cpp: one batch of 512), the best of
--repeats. Peak RSS: the process's own high-water mark (VmHWM) after both. Weights: random GPT-2 weights of the size
(the rates depend on the shapes, not the values). The load average is printed with each round: on a busy machine the
rates mean little.

Usage (from the repository root):
    python -m scripts.bench.int4_speed [--size gpt2] [--threads 2] [--rounds 3] [--repeats 3] [--workdir DIR]
                                       [--compiled] [--wide BITS]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from scripts.bench.generate import prepare
from scripts.bench.safetensors_read import _vm_hwm_kib

PROMPT_LEN, NEW_TOKENS, PREFILL_LEN = 16, 128, 512
CONTENDERS = ("gpt2port int4", "llama.cpp Q4_K_M", "gpt2port int4, compiled", "gpt2port int4, q/k/v and head at")


def q4_k_m_file(ckpt: Path, work: Path, threads: int) -> Path:
    """ckpt as llama.cpp's Q4_K_M (made once under work)."""
    import llama_cpp

    from gpt2port import export
    from gpt2port.targets.gguf import FILE_NAME

    out = work / "q4_k_m.gguf"
    if not out.is_file():
        export(ckpt, work / "f32", to="gguf", dtype="fp32", force=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
        params.nthread = threads
        if llama_cpp.llama_model_quantize(str(work / "f32" / FILE_NAME).encode(), str(out).encode(), params) != 0:
            raise RuntimeError("llama_model_quantize failed")
    return out


def run_int4(ckpt: Path, repeats: int, compiled: bool = False, wide: int | None = None) -> dict:
    from gpt2port import quant4
    from gpt2port.fast import Settings, accelerate
    from gpt2port.fast.int4 import from_pretrained
    from gpt2port.generate import steps

    if wide is not None:  # this process's recipe only: the q/k/v and head at `wide` bits
        quant4.BITS, quant4.HEAD_BITS = {"attn.qkv": wide}, wide

    model = accelerate(from_pretrained(ckpt, "int4"), Settings())
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 50257, (1, PROMPT_LEN), generator=g)
    long = torch.randint(0, 50257, (1, PREFILL_LEN), generator=g)
    decode, prefill, report = [], [], []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first: warm-up (a compiled step is compiled or loaded there)
            t = time.perf_counter()
            tokens = [int(s[0]) for s in steps(model, prompt, max_new_tokens=NEW_TOKENS, temperature=0,
                                               stop_token=None, fast=Settings(compile=compiled), report=report)]
            decode.append(len(tokens) / (time.perf_counter() - t))
            t = time.perf_counter()
            model(long, logits_to_keep=1)
            prefill.append(time.perf_counter() - t)
    # how the timed steps ran: a compiled contender whose step was declined would be the eager one under its name
    how = sorted(set(report[1:]))
    if compiled and not all("compiled ahead of time" in h and "not compiled" not in h for h in how):
        raise SystemExit(f"the compiled contender's steps did not run compiled: {how}")
    return {"decode": max(decode[1:]), "prefill": min(prefill[1:]), "steps": how}


def run_llama(gguf: Path, threads: int, repeats: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf), n_ctx=1024, n_batch=PREFILL_LEN, n_ubatch=PREFILL_LEN, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 50257, (1, PROMPT_LEN), generator=g)[0].tolist()
    long = torch.randint(0, 50257, (1, PREFILL_LEN), generator=g)[0].tolist()
    decode, prefill = [], []
    for _ in range(repeats + 1):
        llm.reset()
        t, n = time.perf_counter(), 0
        for _token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, reset=True):
            n += 1
            if n == NEW_TOKENS:
                break
        decode.append(n / (time.perf_counter() - t))
        llm.reset()
        t = time.perf_counter()
        llm.eval(long)
        prefill.append(time.perf_counter() - t)
    return {"decode": max(decode[1:]), "prefill": min(prefill[1:])}


def child(args) -> None:
    """One contender in this process: its figures and peak RSS as one JSON line."""
    torch.set_num_threads(args.threads)
    if args.one.startswith(CONTENDERS[3]):
        result = run_int4(Path(args.ckpt), args.repeats, wide=int(args.one.split()[-2]))
    elif args.one != CONTENDERS[1]:
        result = run_int4(Path(args.ckpt), args.repeats, compiled=args.one == CONTENDERS[2])
    else:
        result = run_llama(Path(args.gguf), args.threads, args.repeats)
    # VmHWM, its own peak: ru_maxrss would start from the parent's high-water mark (kept across fork)
    result["rss_mb"] = _vm_hwm_kib() / 1024
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="gpt2")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None, help="keep the checkpoint and GGUF files here for reuse")
    ap.add_argument("--compiled", action="store_true", help="also int4 with the step compiled ahead of time "
                    "(GPT2PORT_COMPILE=1's path; its compile in the warm-up, outside the timing)")
    ap.add_argument("--wide", type=int, choices=(4, 6, 8), help="also int4 with the q/k/v and head at this code width "
                    "(gpt2port.quant4.BITS, HEAD_BITS), its recipe set in its own process")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child's mode: a contender's name
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return child(args)
    with tempfile.TemporaryDirectory(prefix="int4-speed-") as tmp:
        root = args.workdir or Path(tmp)
        _, ckpt = prepare(args.size, root)
        try:
            gguf, names = q4_k_m_file(ckpt, root / f"{args.size}-q4_k_m", args.threads), CONTENDERS[:2]
        except ImportError:
            print("llama-cpp-python is not installed: gpt2port int4 alone", file=sys.stderr)
            gguf, names = "", CONTENDERS[:1]
        names += CONTENDERS[2:3] if args.compiled else ()
        names += (f"{CONTENDERS[3]} {args.wide} bits",) if args.wide else ()
        results: dict[str, list[dict]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                cmd = [sys.executable, "-m", "scripts.bench.int4_speed", "--one", name, "--ckpt", str(ckpt), "--gguf",
                       str(gguf), "--threads", str(args.threads), "--repeats", str(args.repeats)]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
                results[name].append(json.loads(out))
                print(f"round {r + 1} {name}: {out} (load average {os.getloadavg()[0]:.2f})", file=sys.stderr)
    print(f"{args.size}, {args.threads} threads, {args.rounds} rounds (best of {args.repeats} each), load average "
          f"at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| | decode tokens/s (median of rounds) | prefill 512 tokens, s | peak RSS MB |\n|---|---:|---:|---:|")
    for name, rs in results.items():
        rounds = ", ".join(f"{x['decode']:.1f}" for x in rs)
        print(f"| {name} | {statistics.median(x['decode'] for x in rs):.1f} ({rounds}) | "
              f"{statistics.median(x['prefill'] for x in rs):.3f} | {max(x['rss_mb'] for x in rs):.0f} |")
    theirs = results.get(CONTENDERS[1])
    for name in (n for n in results if n != CONTENDERS[1] and theirs):
        print(f"{name} / Q4_K_M by round, decode: " + ", ".join(f"{a['decode'] / b['decode']:.2f}x" for a, b in
                                                                 zip(results[name], theirs)))


if __name__ == "__main__":
    main()
