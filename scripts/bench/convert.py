"""Benchmark: converting and loading a GPT-2 checkpoint, gpt2port against the nanoGPT-style baseline, side by side.

Builds a random-weight checkpoint in the 2019 hub layout at --size (default gpt2-xl, 6.4 GB), warms the page cache,
then measures in fresh processes, one after the other in the same run:
  (a) gpt2port convert                           wall time, peak RSS
  (b) nanoGPT-style: HF from_pretrained + own model + copy with transposes + safetensors save_file
  (c) cp of the source file                      the floor: bytes moved through the page cache, nothing else
  load: GPT.from_pretrained(converted) -> first logits  vs  HF GPT2LMHeadModel.from_pretrained -> first logits,
        each in a fresh process, imports included
Targets: (a) wall <= 2.5x (c), peak RSS <= 1.5 GB; load <= 1.0x HF.

With --tf DIR (OpenAI's TensorFlow layout, e.g. written by `scripts/tf_fixtures.py DIR --size gpt2-xl`), instead:
  (a) `gpt2port convert DIR --out OUT` (every tensor's crc32c checked)   wall time, peak RSS
  (a') the same through the Python API (gpt2port.convert) in a fresh interpreter, for comparison
  (c) cp of DIR's data file(s), flushed to disk (gpt2port flushes its output too)
Targets: (a) wall <= 1.5x (c), peak RSS <= 1 GB.

    python -m scripts.bench.convert [--size gpt2-xl] [--workdir /tmp/gpt2port-bench] [--repeat 1] [--keep]
    python -m scripts.bench.convert --tf /tmp/tf-xl [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from scripts import ROOT  # the children run as `python -m scripts...` from here


# --- steps, each run in its own process so its peak RSS is its own -------------------------------------------------

def step_gpt2port(src: Path, out: Path) -> None:
    from gpt2port import convert

    convert(src, out, force=True)


def step_nanogpt(src: Path, out: Path) -> None:
    """What nanoGPT's from_pretrained does (HF model and own model in memory at once), then save_file."""
    import torch
    from safetensors.torch import save_file
    from transformers import GPT2LMHeadModel

    from gpt2port.config import GPTConfig
    from gpt2port.layouts import HF
    from gpt2port.model import GPT

    hf = GPT2LMHeadModel.from_pretrained(src)
    sd_hf = hf.state_dict()
    config = GPTConfig.from_hf_config(hf.config.to_dict())
    model = GPT(config)  # randomly initialised, as nanoGPT does, then overwritten
    sd = model.state_dict()
    reads, _, _ = HF.plan_read(list(sd_hf), config, str(src))
    with torch.no_grad():
        for r in reads:
            sd[r.target].copy_(r.transform.from_layout(sd_hf[r.key], sd[r.target].shape))
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items() if k != "lm_head.weight"}, out / "model.safetensors")


def step_cp(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", str(src / "model.safetensors"), str(out / "model.safetensors")], check=True)


def step_cp_flushed(src: Path, out: Path) -> None:
    """cp of every data shard of a TensorFlow checkpoint, then fsync of the copies (coreutils sync FILE...)."""
    out.mkdir(parents=True, exist_ok=True)
    shards = sorted(src.glob("*.data-*"))
    subprocess.run(["cp", *map(str, shards), str(out)], check=True)
    subprocess.run(["sync", *[str(out / s.name) for s in shards]], check=True)


def step_load_gpt2port(ckpt: Path, _out: Path) -> None:
    import torch

    from gpt2port import GPT

    model = GPT.from_pretrained(ckpt)
    with torch.inference_mode():
        model(torch.tensor([[464, 3290, 373, 1043]]))[0]


def step_load_hf(src: Path, _out: Path) -> None:
    import torch
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(src).eval()
    with torch.inference_mode():
        model(torch.tensor([[464, 3290, 373, 1043]])).logits


STEPS = {"gpt2port": step_gpt2port, "nanogpt": step_nanogpt, "cp": step_cp, "cp_flushed": step_cp_flushed,
         "load_gpt2port": step_load_gpt2port, "load_hf": step_load_hf}


def run_step(name: str, src: Path, out: Path) -> dict:
    """Run one step in a fresh interpreter; its wall time includes interpreter start and imports."""
    t0, cpu0 = time.perf_counter(), machine_cpu()
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.convert", "--step", name, str(src), str(out)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    wall, cpu = time.perf_counter() - t0, [b - a for a, b in zip(cpu0, machine_cpu())]
    if proc.returncode != 0:
        raise SystemExit(f"step {name} failed:\n{proc.stderr[-3000:]}")
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"step": name, "wall_s": wall, "cpu_user_s": cpu[0], "cpu_sys_s": cpu[1], **facts}


def run_cli(src: Path, out: Path) -> dict:
    """`gpt2port convert SRC --out OUT` as a user runs it: its own process, imports and exit included; its peak RSS
    from the kernel's account of that one child (wait4)."""
    t0, cpu0 = time.perf_counter(), machine_cpu()
    proc = subprocess.Popen([sys.executable, "-m", "gpt2port", "convert", str(src), "--out", str(out), "--quiet"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall, cpu = time.perf_counter() - t0, [b - a for a, b in zip(cpu0, machine_cpu())]
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"gpt2port convert failed:\n{proc.stderr.read().decode()[-3000:]}")
    return {"step": "cli", "wall_s": wall, "cpu_user_s": cpu[0], "cpu_sys_s": cpu[1],
            "peak_rss_gb": usage.ru_maxrss * 1024 / 1e9}


def machine_cpu() -> tuple[float, float]:
    """(user, system) CPU seconds of the whole machine so far, from /proc/stat: a step's own and the kernel's
    writeback threads' work alike (on a machine with few cores, the write-back of a 6 GB file is a real cost)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice) / hz, (system + irq + softirq) / hz


def _child_main(name: str, src: str, out: str) -> None:
    t0 = time.perf_counter()
    STEPS[name](Path(src), Path(out))
    inner = time.perf_counter() - t0
    # This process's own peak is its VmHWM (ru_maxrss would start from the harness's high-water mark); for `cp` the
    # peak is the cp child's ru_maxrss (KiB), which starts from this small process's.
    self_rss = _vm_hwm_kib()
    child_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"inner_s": inner, "peak_rss_gb": max(self_rss, child_rss) * 1024 / 1e9}))


def _vm_hwm_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="gpt2-xl")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gpt2port-bench"))
    ap.add_argument("--repeat", type=int, default=1, help="repeat the convert/cp trio, report the best of each")
    ap.add_argument("--skip-baseline", action="store_true", help="skip the nanoGPT-style baseline (needs ~13 GB)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--tf", type=Path, help="a TensorFlow checkpoint directory in OpenAI's layout to convert")
    ap.add_argument("--step", nargs=3, metavar=("NAME", "SRC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.step:
        return _child_main(*args.step)
    if args.tf:
        return bench_tf(args)

    work = args.workdir / args.size
    src = work / "hf"
    if not (src / "model.safetensors").exists():
        print(f"building a random {args.size} checkpoint in the hub layout at {src} ...", file=sys.stderr)
        # In a child: a child's ru_maxrss starts at its parent's high-water mark (Linux keeps it across fork and
        # exec), so this process must stay small for the steps' peaks to be their own.
        subprocess.run([sys.executable, "-m", "scripts.hf_fixtures", str(src), "--size", args.size, "--streamed"],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    size_gb = (src / "model.safetensors").stat().st_size / 1e9
    warm(src / "model.safetensors")

    results: dict[str, dict] = {}
    trio = ["cp", "gpt2port"] + ([] if args.skip_baseline else ["nanogpt"])
    for _ in range(args.repeat):
        for name in trio:
            shutil.rmtree(work / f"out-{name}", ignore_errors=True)  # no step pays for deleting an old output
            # Nor for the previous step's unwritten pages: cp leaves gigabytes dirty for the kernel to write back
            # while the next step runs (gpt2port fsyncs its own output, so it would pay twice).
            os.sync()
            r = run_step(name, src, work / f"out-{name}")
            if name not in results or r["wall_s"] < results[name]["wall_s"]:
                results[name] = r
    for name, ckpt in [("load_hf", src), ("load_gpt2port", work / "out-gpt2port")]:
        warm(ckpt / "model.safetensors")
        results[name] = run_step(name, ckpt, work)

    cp = results["cp"]["wall_s"]
    print(f"\n## convert {args.size} ({size_gb:.2f} GB source, page cache warm, {os.cpu_count()} cores)\n")
    print("| step | wall (s) | x cp | peak RSS (GB) |")
    print("|---|---:|---:|---:|")
    for name in trio:
        r = results[name]
        print(f"| {name} | {r['wall_s']:.1f} | {r['wall_s'] / cp:.2f} | {r['peak_rss_gb']:.2f} |")
    if "nanogpt" in results:
        print(f"\ngpt2port vs nanoGPT-style: {results['nanogpt']['wall_s'] / results['gpt2port']['wall_s']:.1f}x "
              f"faster, {results['nanogpt']['peak_rss_gb'] / results['gpt2port']['peak_rss_gb']:.1f}x less memory")
    lg, lh = results["load_gpt2port"], results["load_hf"]
    print(f"\n## load {args.size} to first logits (fresh process, imports included)\n")
    print("| loader | wall (s) | peak RSS (GB) |")
    print("|---|---:|---:|")
    print(f"| HF GPT2LMHeadModel.from_pretrained | {lh['wall_s']:.1f} | {lh['peak_rss_gb']:.2f} |")
    print(f"| gpt2port GPT.from_pretrained | {lg['wall_s']:.1f} | {lg['peak_rss_gb']:.2f} |")
    print(f"\ngpt2port load = {lg['wall_s'] / lh['wall_s']:.2f}x HF's time")
    print(f"\ntargets: convert {results['gpt2port']['wall_s'] / cp:.2f}x cp (<= 2.5), "
          f"peak RSS {results['gpt2port']['peak_rss_gb']:.2f} GB (<= 1.5), "
          f"load {lg['wall_s'] / lh['wall_s']:.2f}x HF (<= 1.0)")
    print(json.dumps(results), file=sys.stderr)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def bench_tf(args) -> None:
    src, work = args.tf, args.workdir / "tf"
    shards = sorted(src.glob("*.data-*"))
    size_gb = sum(s.stat().st_size for s in shards) / 1e9
    results: dict[str, dict] = {}
    for _ in range(args.repeat):
        for name in ("cp_flushed", "cli", "gpt2port"):
            shutil.rmtree(work / f"out-{name}", ignore_errors=True)
            os.sync()
            for s in shards:
                warm(s)
            r = run_cli(src, work / "out-cli") if name == "cli" else run_step(name, src, work / f"out-{name}")
            if name not in results or r["wall_s"] < results[name]["wall_s"]:
                results[name] = r
    cp, ours = results["cp_flushed"], results["cli"]
    print(f"\n## convert OpenAI's TensorFlow checkpoint {src} ({size_gb:.2f} GB of data, page cache warm, "
          f"{os.cpu_count()} cores; best of {args.repeat})\n")
    print("| step | wall (s) | x cp | peak RSS (GB) | machine CPU user + sys (s) |")
    print("|---|---:|---:|---:|---:|")
    for name, r in (("cp + fsync of the data file", cp), ("`gpt2port convert DIR --out OUT` (crc32c checked)", ours),
                    ("`gpt2port.convert(DIR, OUT)` in a fresh `python`", results["gpt2port"])):
        print(f"| {name} | {r['wall_s']:.1f} | {r['wall_s'] / cp['wall_s']:.2f} | {r['peak_rss_gb']:.2f} | "
              f"{r['cpu_user_s']:.1f} + {r['cpu_sys_s']:.1f} |")
    print(f"\ntargets: {ours['wall_s'] / cp['wall_s']:.2f}x cp (<= 1.5), peak RSS {ours['peak_rss_gb']:.2f} GB (<= 1)")
    print(json.dumps(results), file=sys.stderr)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
