"""How far torch.export + AOTInductor gets as the CPU decode step's capture (issue 49's route to a cached start in
well under a second): the model's own forward for one token, with gpt2port's kernels and KernelCache, exported and
packaged once, then loaded in a fresh process with the model's weights and the cache handed over as user-managed
constants (no copy of them in the package), its logits compared with the forward as it is, its step timed beside it.

Nothing here is used by gpt2port; it measured the route before it was built (docs/performance.md):
  package   seconds to export and package (Inductor's C++ compile included), in this process
  load      seconds to load the package and hand it the weights, in a new process (what a cached start pays on top
            of importing Inductor's loader, which gpt2port.fast.package imports; dynamo is not involved)
  agree     the largest |logit difference| over --steps steps from an empty cache, against the forward as it is
  step      ms per step, packaged and as it is, alternating in one process

The exported module is gpt2port.fast.package's Step (the cache's tensors its buffers, so that export sees the keys
and values as state the step mutates); this script times its parts apart, in fresh processes.

Usage (from the repository root):
    python -m scripts.bench.aoti_probe [--ckpt DIR] [--threads 2] [--steps 8] [--repeats 50]
Without --ckpt, a 2-layer toy model (its package compiles in about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpt2port.fast.package import Step  # what Settings(compile=True) exports

TOKENS = [3, 7, 11, 5, 2, 9, 4, 8, 1, 6, 10, 12]


def _model_and_cache(ckpt: str | None):
    from gpt2port import GPT, GPTConfig
    from gpt2port.fast import Settings, accelerate
    from gpt2port.fast.cache import new_cache

    if ckpt:
        model = GPT.from_pretrained(ckpt)
    else:
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=512, n_positions=64)).eval()
    model = accelerate(model, Settings())
    cache, how = new_cache(model.config, 1, model.config.n_positions, torch.float32, "cpu", None, Settings())
    return model, cache, how


def constants(step: Step, names: list[str]) -> dict[str, torch.Tensor]:
    held = dict(step.named_parameters(remove_duplicate=False))
    held.update(step.named_buffers(remove_duplicate=False))
    return {n: held[n] for n in names}


def package(ckpt: str | None, path: str) -> dict:
    model, cache, how = _model_and_cache(ckpt)
    step = Step(model, cache)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        exported = torch.export.export(step, (torch.tensor([[3]]), torch.tensor([0])), strict=False)
    export_s = time.perf_counter() - t
    torch._inductor.aoti_compile_and_package(exported, package_path=path,
                                             inductor_configs={"aot_inductor.package_constants_in_so": False})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    children = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"attention": how, "export_s": export_s, "package_s": time.perf_counter() - t,
            "cpu_s": time.process_time() - cpu + children, "package_mb": Path(path).stat().st_size / 1e6}


def run(ckpt: str | None, path: str, steps: int, repeats: int) -> dict:
    model, cache, _ = _model_and_cache(ckpt)
    step = Step(model, cache)
    t = time.perf_counter()
    runner = torch._inductor.aoti_load_package(path)
    runner.load_constants(constants(step, runner.get_constant_fqns()), check_full_update=True, user_managed=True)
    load_s = time.perf_counter() - t
    ids = [torch.tensor([[t]]) for t in TOKENS[:steps]]
    with torch.inference_mode():
        cache.k.zero_(), cache.v.zero_()
        packaged = [runner(x, torch.tensor([p])) for p, x in enumerate(ids)]
        cache.k.zero_(), cache.v.zero_()
        eager = [model(x, cache=cache, pos=p, logits_to_keep=1)[0] for p, x in enumerate(ids)]
        agree = max(float((a - b).abs().max()) for a, b in zip(packaged, eager))
        scale = max(float(b.abs().max()) for b in eager)
        times = {"packaged": [], "as it is": []}
        at = torch.tensor([steps])
        for _ in range(repeats):
            t = time.perf_counter()
            runner(ids[0], at)
            times["packaged"].append(time.perf_counter() - t)
            t = time.perf_counter()
            model(ids[0], cache=cache, pos=steps, logits_to_keep=1)
            times["as it is"].append(time.perf_counter() - t)
    ms = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    return {"load_s": load_s, "max_abs_diff": agree, "logit_scale": scale, "step_ms": ms,
            "load_average": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--child", choices=("package", "run"), help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child == "package":
        print(json.dumps(package(args.ckpt, args.path)))
        return
    if args.child == "run":
        print(json.dumps(run(args.ckpt, args.path, args.steps, args.repeats)))
        return
    with tempfile.TemporaryDirectory() as work:
        path = str(Path(work) / "step.pt2")
        base = [sys.executable, "-m", "scripts.bench.aoti_probe", "--threads", str(args.threads), "--path", path,
                "--steps", str(args.steps), "--repeats", str(args.repeats)]
        base += ["--ckpt", args.ckpt] if args.ckpt else []
        # an Inductor cache of its own: a first compile, never a cached one
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(Path(work) / "inductor"))
        for child in ("package", "run"):
            out = subprocess.run(base + ["--child", child], env=env, stdout=subprocess.PIPE, text=True, check=True)
            print(child, out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
