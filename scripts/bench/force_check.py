"""Benchmark: what `--force` pays to check, by content, that it replaces only what gpt2port wrote (ownership.py,
records.py), against the convert it guards; and what recording costs the convert (against a tree before records).

Builds a random-weight checkpoint in the 2019 hub layout at --size (default gpt2-xl, 6.4 GB; the one
scripts/bench/convert.py builds, reused), then, one after the other:
  convert          `gpt2port convert SRC --out OUT`, a fresh process            (the baseline the check is held to)
  convert --force  the same over OUT, which it first checks                   (the check as a user meets it)
  check, as written   ownership.check_replaceable(OUT), every identity as recorded: nothing read
  check, re-hashed    the same after every file's ctime moved (utime to the same times): every file read again,
                      as after a copy (the output written with O_DIRECT is not in the page cache: read from disk)
  convert (before)    with --before DIR, a checkout of the version before records, the same convert: what hashing
                      the output as it streams out costs
Goal (issue 47): the check under 10% of a convert.

    python -m scripts.bench.force_check [--size gpt2-xl] [--workdir /tmp/gpt2port-bench] [--before /path/to/old]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from scripts import ROOT


def convert(src: Path, out: Path, force: bool = False, tree: Path = ROOT) -> float:
    """Wall seconds of `gpt2port convert` in a fresh process, imports and exit included, run from `tree`."""
    os.sync()  # no step pays for the last one's unwritten pages
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "gpt2port", "convert", str(src), "--out", str(out), "--quiet",
                    *(["--force"] if force else [])], cwd=tree, check=True,
                   env={**os.environ, "PYTHONPATH": str(tree)})
    return time.perf_counter() - t0


def check(out: Path) -> float:
    """Wall seconds of the check alone, in a fresh process (nothing of this one's cached)."""
    code = ("import sys, time; from gpt2port.fsio import check_replaceable; t = time.perf_counter(); "
            "check_replaceable(sys.argv[1]); print(time.perf_counter() - t)")
    proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, check=True, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return float(proc.stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="gpt2-xl")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gpt2port-bench"))
    ap.add_argument("--before", type=Path, help="a checkout of gpt2port before records, to time its convert too")
    ap.add_argument("--keep", action="store_true", help="keep the outputs (the source is always kept)")
    args = ap.parse_args()
    work = args.workdir / args.size
    src, out = work / "hf", work / "out-force"
    if not (src / "model.safetensors").exists():
        print(f"building a random {args.size} checkpoint in the hub layout at {src} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "scripts.hf_fixtures", str(src), "--size", args.size, "--streamed"],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(out, ignore_errors=True)
    rows = []
    if args.before:
        rows.append(("convert (version before records)", convert(src, out, tree=args.before.resolve())))
        shutil.rmtree(out)
    base = convert(src, out)
    rows.append(("convert", base))
    rows.append(("convert --force over it", convert(src, out, force=True)))
    rows.append(("check, as written (identities as recorded)", check(out)))
    for f in out.iterdir():
        st = f.stat()
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same times: only the ctime moves
    rows.append(("check, every file re-hashed", check(out)))
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e9
    print(f"\n## --force's check, {args.size} ({size:.2f} GB output), load {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores\n")
    print("| step | wall (s) | x convert |")
    print("|---|---:|---:|")
    for name, s in rows:
        print(f"| {name} | {s:.2f} | {s / base:.3f} |")
    if not args.keep:
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
