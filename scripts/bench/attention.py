"""What a decode step spends outside its matrix products, and what gpt2port's own kernels for it save: attention for
one new token (gpt2port/fast/attention.c) against PyTorch's scaled_dot_product_attention with the cache writes,
slices and reshapes a step makes around it, and the operators' C++ kernels (gpt2port/fast/native_ops.cpp) against a
kernel written in Python, as a PyTorch without a C++ compiler gets.

  attention  one layer's attention for one token of one sequence, GPT-2's 12 heads of 64, after `length` cached
             positions: gpt2port::attend_one against SDPA plus its cache writes and reshapes, in microseconds, warm (the
             layer's cache just read) and cold (12 layers' caches, a 64 MB buffer written between passes, as in a step,
             where a layer's keys were last read ~40 MB of weights ago).
  --against  with another version of attention.c (e.g. `git show REV:gpt2port/fast/attention.c > old.c`): the
             attention rows for it and for this checkout's, both built here with the same compiler and flags and
             called the same way (ctypes), alternately, on the same caches.
  op call    microseconds a call of gpt2port::matvec costs from Python on a 4 x 768 weight, its C++ kernel
             against the same library reached through a Python kernel (registered here under another name).
  step       a whole 124M decode step (the model's forward) (random weights, 16-token prompt, 127 steps), with attention
             on gpt2port's kernel against SDPA, the two run alternately step by step on caches of their own (this
             machine's bandwidth swings from minute to minute; neighbouring steps see the same): the median of the
             paired differences.

Usage (from the repository root):
    python -m scripts.bench.attention [--threads 2] [--rounds 6] [--workdir DIR] [--against OLD.c]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from gpt2port import GPT
from gpt2port.fast import Settings, accelerate, decode_step, native
from gpt2port.fast.cache import new_cache
from scripts.bench import scratch_root
from scripts.bench.generate import prepare

H, D, LAYERS = 12, 64, 12


def sdpa_attention(qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int) -> torch.Tensor:
    """What a step does without attend_one: the cache writes, slices and SDPA, in that order."""
    q, k, v = qkv.view(1, 3, H, 1, D).unbind(1)
    keys.narrow(2, length, 1).copy_(k)
    values.narrow(2, length, 1).copy_(v)
    y = F.scaled_dot_product_attention(q, keys.narrow(2, 0, length + 1), values.narrow(2, 0, length + 1))
    return y.transpose(1, 2).reshape(1, H * D)


def built(source: Path, workdir: Path, qkv: torch.Tensor) -> Callable:
    """attention.c's fp32 function from `source`, built as gpt2port builds its library, as (keys, values, length) ->
    y; qkv, the output and the scratch are the caller's and fixed, as in the other contenders."""
    cc = native.compiler()
    if cc is None:
        raise SystemExit("--against needs a C compiler ($CC, cc, gcc or clang)")
    path = workdir / f"attention-{len(list(workdir.glob('attention-*.so')))}.so"
    error = native._build([cc, *native.FLAG_SETS[0], "-shared", "-fPIC", "-I", str(native.SOURCES[0].parent),
                           str(source), "-lm"], path)
    if error is not None:
        raise SystemExit(f"{source}: {error}")
    fn = ctypes.CDLL(str(path)).gpt2port_attend_one
    fn.restype = None
    y, scratch = torch.empty(H * D), torch.empty(H * (1024 + 1 + 2 * D))
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64

    def call(keys: torch.Tensor, values: torch.Tensor, length: int) -> torch.Tensor:
        fn(pointer(qkv.data_ptr()), pointer(keys.data_ptr()), pointer(values.data_ptr()), pointer(y.data_ptr()),
           i64(H), i64(keys.size(2)), i64(D), i64(length), ctypes.c_float(D ** -0.5), pointer(scratch.data_ptr()),
           ctypes.c_int(torch.get_num_threads()))
        return y

    return call


def attention_us(lengths: list[int], repeats: int, against: Path | None = None, workdir: Path | None = None
                 ) -> list[dict]:
    caches = [(torch.randn(1, H, 1024, D), torch.randn(1, H, 1024, D)) for _ in range(LAYERS)]
    qkv, flush = torch.randn(3 * H * D), torch.zeros(16 << 20)
    if against is not None:  # this checkout's kernel and the other, each alone, called the same way
        kernels = {"this checkout": built(native.SOURCES[1], workdir, qkv), "against": built(against, workdir, qkv)}
    else:
        kernels = {"gpt2port": lambda k, v, n: torch.ops.gpt2port.attend_one(qkv, k, v, n, None),
                   "SDPA": lambda k, v, n: sdpa_attention(qkv, k, v, n)}
    rows = []
    with torch.inference_mode():
        for length in lengths:
            times = {name: ([], []) for name in kernels}
            for _ in range(repeats):  # the contenders in turn: each repeat sees the same minute of this VM
                for name, fn in kernels.items():
                    warm, cold = times[name]
                    t = time.perf_counter()
                    for k, v in caches:
                        fn(k, v, length)
                    warm.append((time.perf_counter() - t) / LAYERS)
                    flush.add_(1.0)  # 64 MB through the caches: every layer's keys and values evicted
                    for k, v in caches:
                        t = time.perf_counter()
                        fn(k, v, length)
                        cold.append(time.perf_counter() - t)
            rows.append({"length": length, **{name: (1e6 * min(warm), 1e6 * statistics.median(cold))
                                              for name, (warm, cold) in times.items()}})
    return rows


def op_call_us(calls: int = 20000) -> dict[str, float]:
    """gpt2port::matvec's C++ kernel against the library behind a Python kernel, each called from Python."""
    built = native.kernels()
    lib = torch.library.Library("gpt2port_bench", "DEF")
    lib.define("matvec(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
    lib.impl("matvec", functools.partial(native._matvec, built.lib), "CPU")
    ops = {"C++ kernel": torch.ops.gpt2port.matvec, "Python kernel": torch.ops.gpt2port_bench.matvec}
    x, w, best = torch.randn(1, 768), torch.randn(4, 768), {}
    with torch.inference_mode():
        for _ in range(3):
            for name, op in ops.items():
                t = time.perf_counter()
                for _ in range(calls):
                    op(x, w, None)
                best[name] = min(best.get(name, float("inf")), 1e6 * (time.perf_counter() - t) / calls)
    return best


def step_ms(ckpt: Path, rounds: int) -> dict[str, float]:
    model = accelerate(GPT.from_pretrained(ckpt), Settings())
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    settings = {"gpt2port": Settings(), "SDPA": Settings(attend_one=False)}
    times: dict[str, list[float]] = {name: [] for name in settings}
    with torch.inference_mode():
        for _ in range(rounds):
            steps = {}
            for name, s in settings.items():
                cache, attention = new_cache(model.config, 1, 16 + 127, torch.float32, "cpu", None, s)
                model(prompt, cache=cache, logits_to_keep=1)
                steps[name] = decode_step(model, cache, s, attention)
            token = prompt[:, -1:]
            for pos in range(16, 16 + 127):
                for name, step in steps.items():
                    t = time.perf_counter()
                    logits = step(token, pos)
                    times[name].append(time.perf_counter() - t)
                token = logits[:, -1].argmax(-1).view(1, 1)
    difference = [a - b for a, b in zip(times["gpt2port"], times["SDPA"])]
    return {"gpt2port": 1e3 * statistics.median(times["gpt2port"]), "SDPA": 1e3 * statistics.median(times["SDPA"]),
            "paired difference": 1e3 * statistics.median(difference), "steps": len(difference)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--against", type=Path, default=None, help="another version of gpt2port/attention.c")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not native.kernels().attend_one:
        why = native.kernels().binding_why_not
        raise SystemExit(f"gpt2port's attention kernel is not in use here: {why}")
    print(f"torch {torch.__version__}, {args.threads} threads")
    root = args.workdir or scratch_root("gpt2port-bench-")
    if args.against is not None:
        print(f"attention, one layer (12 heads of 64), us: this checkout's attention.c warm / cold, "
              f"{args.against}'s warm / cold")
        for row in attention_us([16, 80, 144, 512, 1023], 20, args.against, root):
            (nw, nc), (bw, bc) = row["this checkout"], row["against"]
            print(f"  after {row['length']:>4} positions: {nw:6.1f} / {nc:6.1f}   {bw:6.1f} / {bc:6.1f}   "
                  f"warm {bw / nw:.2f}x, cold {bc / nc:.2f}x")
        return
    print("attention, one layer (12 heads of 64), us: gpt2port warm / cold, SDPA warm / cold")
    for row in attention_us([16, 80, 144, 512, 1023], repeats=20):
        (ow, oc), (sw, sc) = row["gpt2port"], row["SDPA"]
        print(f"  after {row['length']:>4} positions: {ow:6.1f} / {oc:6.1f}   {sw:6.1f} / {sc:6.1f}   "
              f"cold {sc / oc:.2f}x")
    calls = op_call_us()
    print("gpt2port::matvec from Python, 4 x 768, us a call: " +
          ", ".join(f"{k} {v:.2f}" for k, v in calls.items()))
    _, ckpt = prepare("gpt2", root)
    got = step_ms(ckpt, args.rounds)
    print(f"124M step, median ms: attention on gpt2port {got['gpt2port']:.3f}, on SDPA {got['SDPA']:.3f}; "
          f"paired difference {got['paired difference']:+.3f} ms over {got['steps']} steps")


if __name__ == "__main__":
    main()
