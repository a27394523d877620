"""gpt2port's int4 decode kernel (gpt2port/fast/int4.c) against itself at another commit, side by side, in one process.

Both versions of int4.c (the working tree's and `--against`'s, read with `git show`) are built with native.py's flags
into libraries of their own, each packs the same random trained-scale weights with its own quantizer, and both
multiply one row by each matrix of one decode step (every matrix once, in the model's order), alternating round by
round. "cold": the step's matrices held in --copies distinct copies (a 124M step is 100 MB; 4 copies are more than
this host's caches), a different copy each round, as a real step finds them; "hot": one matrix of each shape, over and
over (in cache). Figures: CPU time (time.process_time) at --threads 1, the best of the rounds; at more threads wall
time (CPU time would count the threads' waiting), so run those on a quiet host. The load average is printed.

Usage (from the repository root):
    python -m scripts.bench.int4_kernel [--against main] [--size gpt2] [--threads 1] [--rounds 8] [--copies 4]
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from gpt2port.config import GPTConfig, canonical_name
from gpt2port.fast import native
from gpt2port.quant4 import CANDIDATE_STEP, CANDIDATES, bits_for
from scripts import ROOT

FILES = ("gpt2port/fast/int4.c", "gpt2port/fast/int4_fit.c", "gpt2port/fast/int4.h", "gpt2port/fast/vectors.h")


def build(sources: dict[str, bytes], out: Path) -> ctypes.CDLL:
    """int4.c (and int4_fit.c, where the version has one) built as native.py builds the library (its first flag
    set), into out."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in sources.items():
        (out / Path(name).name).write_bytes(text)
    lib = out / "libint4.so"
    c_files = [str(out / Path(name).name) for name in sources if name.endswith(".c")]
    subprocess.run([native.compiler() or "cc", *native.FLAG_SETS[0], "-shared", "-fPIC", *c_files, "-lm", "-o",
                    str(lib)], check=True)
    dll = ctypes.CDLL(str(lib))
    dll.gpt2port_matvec_int4.restype = ctypes.c_int
    dll.gpt2port_matvec_int4.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2
    dll.gpt2port_quantize_int4.restype = None
    dll.gpt2port_quantize_int4.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int] * 2 + \
        [ctypes.c_float, ctypes.c_int]
    return dll


def row_width(dll: ctypes.CDLL, k: int, bits: int) -> int:
    """Bytes of a packed row of k numbers in this version's layout (its own say where it has one)."""
    fn = getattr(dll, "gpt2port_int4_row_bytes", None)
    if fn is None:
        return k * bits // 8 + 4 * (k // 32)
    fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_int64, ctypes.c_int]
    return fn(k, bits)


def step(config: GPTConfig, wide: int | None = None) -> list[tuple[str, int, int, int]]:
    """(kind, out, in, bits) of one decode step's products, in order, at gpt2port.quant4's code widths (`wide`: the
    q/k/v and head's instead, for a version of int4.c from before them)."""
    d, out = config.n_embd, []
    bits = {kind: wide or bits_for(name) for kind, name in (("qkv", "attn.qkv"), ("head", "lm_head"))}
    for _ in range(config.n_layer):
        out += [("qkv", 3 * d, d, bits["qkv"]), ("attn.proj", d, d, bits_for("attn.proj")),
                ("fc", 4 * d, d, bits_for("mlp.fc")), ("mlp.proj", d, 4 * d, bits_for("mlp.proj"))]
    return out + [("head", config.vocab_size, d, bits["head"])]


def pack(dll: ctypes.CDLL, shapes, seed: int = 0) -> dict[tuple[int, int, int], torch.Tensor]:
    """One packed matrix per distinct (out, in, bits), of N(0, 2.5 / sqrt(in)) weights (a trained GPT-2's scale)."""
    g, packed = torch.Generator().manual_seed(seed), {}
    for _, n, k, bits in shapes:
        if (n, k, bits) not in packed:
            w = torch.randn(n, k, generator=g) * 2.5 / math.sqrt(k)
            p = torch.empty(n, row_width(dll, k, bits), dtype=torch.uint8)
            dll.gpt2port_quantize_int4(w.data_ptr(), p.data_ptr(), n, k, bits, CANDIDATES, CANDIDATE_STEP,
                                       torch.get_num_threads())
            packed[n, k, bits] = p
    return packed


def run(dll, mats, shapes, x, y, threads: int, clock) -> dict[str, float]:
    """Seconds per kind of product (and "step": all), each matrix of `mats` once in order."""
    spent: dict[str, float] = {}
    first = clock()
    for (kind, n, k, bits), p in zip(shapes, mats):
        t = clock()
        dll.gpt2port_matvec_int4(p.data_ptr(), x[k].data_ptr(), None, y.data_ptr(), n, k, bits, threads)
        spent[kind] = spent.get(kind, 0.0) + clock() - t
    spent["step"] = clock() - first
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default="main", help="the commit whose int4.c is the baseline")
    ap.add_argument("--size", default="gpt2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--against-bits", type=int, default=None, help="the baseline's q/k/v and head code width (8 for "
                    "an int4.c from before 6-bit codes; default: the working tree's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    config = GPTConfig.preset(canonical_name(args.size))
    shapes = {"working tree": step(config), args.against: step(config, args.against_bits)}
    clock = time.process_time if args.threads == 1 else time.perf_counter
    trees = {"working tree": {f: (ROOT / f).read_bytes() for f in FILES},
             args.against: {f: shown.stdout for f in FILES
                            if (shown := subprocess.run(["git", "show", f"{args.against}:{f}"], cwd=ROOT,
                                                        capture_output=True)).returncode == 0}}  # its files
    g = torch.Generator().manual_seed(1)
    x = {k: torch.randn(k, generator=g) for _, _, k, _ in shapes["working tree"]}
    y = torch.empty(max(n for _, n, _, _ in shapes["working tree"]))
    with tempfile.TemporaryDirectory(prefix="int4-kernel-") as tmp:
        versions = {}
        for i, (name, sources) in enumerate(trees.items()):
            dll = build(sources, Path(tmp) / str(i))
            one = pack(dll, shapes[name])
            copies = [[one[n, k, b].clone() for _, n, k, b in shapes[name]] for _ in range(args.copies)]
            versions[name] = (dll, one, copies)
        step_mb = sum(p.numel() for p in versions[args.against][2][0]) / 1e6
        cold = {name: [] for name in versions}
        hot = {name: {} for name in versions}
        for r in range(args.rounds):
            for name in list(versions) if r % 2 == 0 else list(versions)[::-1]:
                dll, one, copies = versions[name]
                cold[name].append(run(dll, copies[r % args.copies], shapes[name], x, y, args.threads, clock))
                for (kind, n, k, b) in dict.fromkeys(shapes[name]):
                    repeat = max(1, 20_000_000 // (n * k))
                    t = clock()
                    for _ in range(repeat):
                        dll.gpt2port_matvec_int4(one[n, k, b].data_ptr(), x[k].data_ptr(), None, y.data_ptr(), n, k,
                                                 b, args.threads)
                    per = (clock() - t) / repeat
                    hot[name][kind] = min(hot[name].get(kind, math.inf), per)
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    kinds = list(dict.fromkeys(kind for kind, *_ in shapes[args.against]))
    print(f"{args.size}, {args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} time, best of "
          f"{args.rounds} rounds; step {step_mb:.1f} MB in {args.against}'s layout; load average {load}")
    print("| int4.c | " + " | ".join(f"cold {k} ms" for k in kinds) + " | cold step ms | step GB/s | " +
          " | ".join(f"hot {k} us" for k in kinds) + " |")
    print("|---|" + "---:|" * (2 * len(kinds) + 2))
    for name in versions:
        best = {k: min(c[k] for c in cold[name]) for k in [*kinds, "step"]}
        nbytes = sum(p.numel() for p in versions[name][2][0])
        print(f"| {name} ({nbytes / 1e6:.1f} MB) | " + " | ".join(f"{best[k] * 1e3:.2f}" for k in kinds) +
              f" | {best['step'] * 1e3:.2f} | {nbytes / best['step'] / 1e9:.1f} | " +
              " | ".join(f"{hot[name][k] * 1e6:.1f}" for k in kinds) + " |")


if __name__ == "__main__":
    main()
