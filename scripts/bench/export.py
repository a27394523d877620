"""export --to gguf against a flushed `cp` of a file of the same size, side by side, each in a fresh process; a
quantized type (q4_k_m, ...) against llama.cpp's quantizer instead.

    python -m scripts.bench.export CKPT [--dtype fp32] [--repeat 2]

Prints wall seconds and peak RSS (VmHWM, from /usr/bin/time -v) for both, and the ratio. Both start from the same
state: the checkpoint's weights read once into the page cache and every dirty page synced, untimed. The cp copies
those weights (what the export reads; the same size as an fp32 GGUF, on the same disk) and is followed by `sync`, as
the export fsyncs its output. For a quantized type the baseline is what a llama.cpp user runs: `llama-quantize`
(llama-cpp-python's llama_model_quantize, on all cores as llama-quantize's default, in a fresh Python) from the f32
GGUF export of the checkpoint (made once, untimed, warm in the page cache), to the same type; gpt2port's export
reads the checkpoint itself. Needs llama-cpp-python for those.
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

from gpt2port.registry import GGUF_QUANTS


def timed(cmd: list[str]) -> tuple[float, int, float]:
    """(wall seconds, peak RSS in KiB, CPU seconds: user + system) of a command in a fresh process."""
    t0 = time.perf_counter()
    run = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if run.returncode:
        sys.exit(f"{cmd}: failed:\n{run.stderr[-2000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr).group(1))
    cpu = sum(float(re.search(rf"{kind} time \(seconds\): ([\d.]+)", run.stderr).group(1))
              for kind in ("User", "System"))
    return wall, rss, cpu


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

        quantized = args.dtype in GGUF_QUANTS and args.dtype != "q8_0"
        if quantized:  # llama-quantize's input, made once
            subprocess.run([sys.executable, "-m", "gpt2port", "export", args.ckpt, "--to", "gguf", "--dtype", "fp32",
                            "--out", str(work / "f32")], check=True, capture_output=True)
        baseline_name = "llama-quantize" if quantized else "cp+sync"
        for i in range(args.repeat):
            out = work / f"g{i}"
            settle()
            ex = timed([sys.executable, "-m", "gpt2port", "export", args.ckpt, "--to", "gguf", "--dtype", args.dtype,
                        "--out", str(out)])
            size = next(out.iterdir()).stat().st_size / 1e9
            settle()
            if quantized:
                subprocess.run(["sh", "-c", f"cat '{work}/f32/model.gguf' > /dev/null && sync"], check=True)
                base = timed([sys.executable, "-c", "import os, sys; from scripts.check_gguf_kquants import "
                              "llama_quantize; llama_quantize(sys.argv[1], sys.argv[2], sys.argv[3], os.cpu_count()); "
                              "os.sync()", str(work / "f32" / "model.gguf"), str(work / "copy"), args.dtype])
            else:
                base = timed(["sh", "-c", f"cp '{weights}' '{work}/copy' && sync"])
            print(f"run {i}: {size:.3f} GB  export {ex[0]:.2f} s ({ex[2]:.1f} CPU s), {ex[1] / 1024:.0f} MB peak RSS | "
                  f"{baseline_name} {base[0]:.2f} s ({base[2]:.1f} CPU s), {base[1] / 1024:.0f} MB | "
                  f"ratio {ex[0] / base[0]:.2f}x", flush=True)
            shutil.rmtree(out)
            (work / "copy").unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
