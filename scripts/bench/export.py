"""export --to gguf against a flushed `cp` of a file of the same size, side by side, each in a fresh process.

    python -m scripts.bench.export CKPT [--dtype fp32] [--repeat 2]

Prints wall seconds and peak RSS (VmHWM, from /usr/bin/time -v) for both, and the ratio. Both start from the same
state: the checkpoint's weights read once into the page cache and every dirty page synced, untimed. The cp copies
those weights (what the export reads; the same size as an fp32 GGUF, on the same disk) and is followed by `sync`, as
the export fsyncs its output.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS in KiB) of a command in a fresh process."""
    t0 = time.perf_counter()
    run = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if run.returncode:
        sys.exit(f"{cmd}: failed:\n{run.stderr[-2000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr).group(1))
    return wall, rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None, help="a directory on the disk to measure (default: $TMPDIR)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(dir=args.work))
    try:
        weights = Path(args.ckpt) / "model.safetensors"

        def settle() -> None:  # untimed: the source warm in the page cache, no dirty pages left to bill a step
            subprocess.run(["sh", "-c", f"cat '{weights}' > /dev/null && sync"], check=True)

        for i in range(args.repeat):
            out = work / f"g{i}"
            settle()
            ex = timed([sys.executable, "-m", "gpt2port", "export", args.ckpt, "--to", "gguf", "--dtype", args.dtype,
                        "--out", str(out)])
            size = next(out.iterdir()).stat().st_size / 1e9
            settle()
            cp = timed(["sh", "-c", f"cp '{weights}' '{work}/copy' && sync"])
            print(f"run {i}: {size:.2f} GB  export {ex[0]:.2f} s, {ex[1] / 1024:.0f} MB peak RSS | "
                  f"cp+sync {cp[0]:.2f} s, "
                  f"{cp[1] / 1024:.0f} MB | ratio {ex[0] / cp[0]:.2f}x")
            shutil.rmtree(out)
            (work / "copy").unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
