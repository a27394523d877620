"""Wall time, peak RSS and measured errors of `gpt2port verify` at the four GPT-2 sizes, on random weights.

For each size: a full-size random-weight hub-layout HF directory (hf_fixtures.write_random_hub_file, fp32, with the
genuine tokenizer files), converted by `gpt2port convert --dtype D` for each requested dtype, then
`gpt2port verify CKPT --json` run as a child process. Its peak RSS comes from os.wait4 on exactly that child (not
the converter, not this script); its wall time is measured around it. The errors it measured (ours and HF against
the float64 reference) are the numbers behind gpt2port.verification.TOLERANCES.

Usage (from the repository root):
    python -m scripts.bench.verify --sizes gpt2                       # one size, fp32, full 1024-token inputs
    python -m scripts.bench.verify --sizes gpt2,gpt2-medium --dtypes fp32,bf16 --tokens 128
    python -m scripts.bench.verify                                    # all four sizes (gpt2-xl needs ~13 GB disk)
Prints a markdown table; --json-out FILE also saves every verify report.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from scripts import ROOT  # the hf_fixtures child runs as `python -m scripts.hf_fixtures` from here
SIZES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
GPT2PORT = [sys.executable, "-m", "gpt2port"]


def make_source(work: Path, size: str) -> Path:
    """The random-weight HF directory for `size`, made once and reused by later runs with the same --workdir."""
    src = work / size / "hf"
    if (src / "model.safetensors").is_file() and (src / "config.json").is_file():
        return src
    # In a child process (with the genuine tokenizer files): a child's ru_maxrss starts at its parent's high-water
    # mark, so this process stays small for the verify peaks measured below to be verify's own.
    subprocess.run([sys.executable, "-m", "scripts.hf_fixtures", str(src), "--size", size, "--streamed"],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return src


def convert(src: Path, out: Path, dtype: str) -> None:
    if (out / "model.safetensors").is_file():
        return
    subprocess.run(GPT2PORT + ["convert", str(src), "--out", str(out), "--dtype", dtype, "--force", "-q"],
                   check=True, stdout=subprocess.DEVNULL)


class RssSampler(threading.Thread):
    """Samples a child's resident memory from /proc every `period` seconds: (seconds since start, anon GB, file GB).

    RssFile is file pages mapped into the process: the memory-mapped checkpoint pages it has touched (clean page
    cache, but counted in RSS and in ru_maxrss) plus ~0.5 GB of shared libraries; RssAnon is what it allocated.
    Where the peak falls tells which phase of verify to slim down.
    """

    def __init__(self, pid: int, t0: float, period: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.t0, self.period = pid, t0, period
        self.samples: list[tuple[float, float, float]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period):
            try:
                fields = dict(line.split(":", 1) for line in Path(f"/proc/{self.pid}/status").read_text().splitlines())
            except (OSError, ValueError):
                return
            kb = lambda k: int(fields.get(k, "0 kB").split()[0]) / 1024**2  # noqa: E731
            self.samples.append((time.perf_counter() - self.t0, kb("RssAnon"), kb("RssFile") + kb("RssShmem")))


def run_measured(cmd: list[str]) -> tuple[int, float, float, str, list]:
    """(exit code, wall seconds, peak RSS in GB of this child alone, stdout, RSS samples)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err_file:
        t0 = time.perf_counter()
        child = subprocess.Popen(cmd, stdout=out, stderr=err_file)  # files, not pipes: nothing blocks the child
        sampler = RssSampler(child.pid, t0)
        sampler.start()
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - t0
        sampler.done.set()
        sampler.join()
        child.returncode = os.waitstatus_to_exitcode(status)
        err_file.seek(0)
        err = err_file.read().decode(errors="replace")
        out.seek(0)
        text = out.read().decode()
    if child.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} exited {child.returncode}:\n{err[-2000:]}")
    return child.returncode, wall, usage.ru_maxrss / 1024**2, text, sampler.samples  # ru_maxrss: KiB on Linux


def phase_peaks(samples: list, wall: float, timings: dict) -> dict:
    """Peak sampled RSS (anon + file, GB) of each verify phase, placed by the report's own phase timings counted
    back from the child's exit: hf ends last, reference before it, ours before that; "load" is everything earlier
    (imports, the checkpoint's load). Approximate by the seconds spent between phases (comparisons, JSON)."""
    ends, t = {}, wall
    for phase in ("hf", "reference", "ours"):
        ends[phase] = t
        t -= timings.get(phase) or 0.0
    ends["load"] = t
    order = ["load", "ours", "reference", "hf"]
    peaks = {}
    for at, anon, file in samples:
        phase = next((p for p in order if at <= ends[p]), "hf")
        best = peaks.get(phase)
        if best is None or anon + file > best["rss"]:
            peaks[phase] = {"rss": anon + file, "anon": anon, "file": file}
    return {p: peaks[p] for p in order if p in peaks}


def bench_one(work: Path, size: str, dtype: str, tokens: int | None, no_hf: bool) -> dict:
    """int8: the fp32 checkpoint, quantized as verify loads it (--dtype int8)."""
    src = make_source(work, size)
    stored = "fp32" if dtype == "int8" else dtype
    ckpt = work / size / f"ckpt-{stored}"
    convert(src, ckpt, stored)
    cmd = GPT2PORT + ["verify", str(ckpt), "--json"] + (["--tokens", str(tokens)] if tokens else [])
    cmd += ["--dtype", "int8"] if dtype == "int8" else []
    cmd += ["--no-hf"] if no_hf else []
    code, wall, rss, text, samples = run_measured(cmd)
    report = json.loads(text)
    peaks = phase_peaks(samples, wall, report["timings"])
    print(f"[{size} {dtype}] peak RSS by phase (GB, anon + mapped file): " + ", ".join(
        f"{p} {v['rss']:.2f} ({v['anon']:.2f} + {v['file']:.2f})" for p, v in peaks.items()), file=sys.stderr)
    overall = report["metrics"]["overall"]
    worst = max(report["localization"]["stages"], key=lambda s: s["rel"])
    return {"size": size, "dtype": dtype, "params": report["model"]["n_params"], "exit": code,
            "verdict": report["verdict"], "wall_s": wall, "peak_rss_gb": rss, "phase_peaks": peaks,
            "timings": report["timings"],
            "random": next(i["shape"] for i in report["inputs"] if i["kind"] == "random"),
            "ours": overall["ours_vs_f64"], "hf": overall["hf_vs_f64"], "worst_stage": worst,
            "greedy": overall.get("greedy"), "loss": overall.get("loss"), "report": report}


def _e(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def table(rows: list[dict]) -> str:
    head = ("| size | params | dtype | random ids | verdict | wall s | peak RSS GB | ours / f64 / HF s "
            "| ours max rel | HF max rel | ours KL | HF KL | worst stage rel | cached rel | loss diff |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        t = r["timings"]
        hf = r["hf"] or {}
        g, loss = r["greedy"] or {}, r["loss"] or {}
        lines.append(
            f"| {r['size']} | {r['params'] / 1e6:.0f}M | {r['dtype']} | {'x'.join(map(str, r['random']))} "
            f"| {r['verdict']} | {r['wall_s']:.0f} | {r['peak_rss_gb']:.2f} "
            f"| {t['ours']:.0f} / {t['reference']:.0f} / {t['hf'] or 0:.0f} "
            f"| {_e(r['ours']['max_rel'])} | {_e(hf.get('max_rel'))} | {_e(r['ours']['kl_mean'])} "
            f"| {_e(hf.get('kl_mean'))} | {_e(r['worst_stage']['rel'])} ({r['worst_stage']['stage']}) "
            f"| {_e(g.get('cached_max_rel'))} | {_e(loss.get('max_diff'))} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, from {', '.join(SIZES)}")
    ap.add_argument("--dtypes", default="fp32",
                    help="comma-separated checkpoint dtypes: fp32, fp16, bf16; int8 (fp32 weights quantized at load)")
    ap.add_argument("--tokens", type=int, default=None, help="random-id input length (default: full context)")
    ap.add_argument("--no-hf", action="store_true", help="float64 reference only")
    ap.add_argument("--workdir", type=Path, default=None, help="keep (and reuse) the random checkpoints here")
    ap.add_argument("--json-out", type=Path, default=None, help="save every full verify report here")
    args = ap.parse_args()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"unknown size(s) {unknown}; choose from {', '.join(SIZES)}")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-verify-"))
    rows = []
    try:
        for size in sizes:
            for dtype in args.dtypes.split(","):
                print(f"[{size} {dtype}] ...", file=sys.stderr, flush=True)
                rows.append(bench_one(work, size, dtype.strip(), args.tokens, args.no_hf))
                r = rows[-1]
                print(f"[{size} {dtype}] {r['verdict']} in {r['wall_s']:.0f}s, peak RSS {r['peak_rss_gb']:.2f} GB",
                      file=sys.stderr, flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"gpt2port verify on random-weight checkpoints; {os.cpu_count()} CPUs, torch threads default\n")
    print(table(rows))
    if args.json_out:
        args.json_out.write_text(json.dumps([r["report"] for r in rows], indent=2))


if __name__ == "__main__":
    main()
