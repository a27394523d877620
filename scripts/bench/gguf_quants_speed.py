"""CPU seconds of gpt2port's GGML quantizers against the `gguf` package's, side by side on the same realistic-scale
matrix, one thread each. Two baselines for the 32-value types: the package called as gpt2port called it before it
had its own (chunks of 2048 blocks, each a (2048, 32) array, so the package's 16-row groups are 16 blocks), and the
package on the whole matrix (16 rows of 1600 values per numpy call).

    python -m scripts.bench.gguf_quants_speed [--rows 1600] [--width 1600] [--repeat 3]

Prints, per type, the best of --repeat process-CPU times for each quantizer and whether their bytes are equal. The
K-quants have no baseline there (the package cannot write them): their own time is printed.
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np

from gpt2port.formats import gguf_quants
from scripts.check_gguf_kquants import hard_matrix


def cpu(fn, repeat: int) -> tuple[float, np.ndarray]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1600)
    ap.add_argument("--width", type=int, default=1600)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    x = hard_matrix(args.rows, args.width, seed=args.width)
    print(f"{args.rows} x {args.width} float32, best of {args.repeat}, CPU seconds")
    for qtype in gguf_quants.TYPES:
        if args.width % gguf.GGML_QUANT_SIZES[qtype][0]:
            continue
        ours, a = cpu(lambda q=qtype: gguf_quants.quantize(x, q), args.repeat)
        if qtype not in gguf_quants.TYPES[:5]:
            print(f"{qtype.name:5s} gpt2port {ours:.3f} s | gguf package: cannot write it")
            continue
        blocks = x.reshape(-1, 32)
        before, b = cpu(lambda q=qtype: np.concatenate(
            [gguf.quants.quantize(blocks[i : i + 2048], q) for i in range(0, len(blocks), 2048)]), args.repeat)
        whole, c = cpu(lambda q=qtype: gguf.quants.quantize(x, q), args.repeat)
        same = np.array_equal(a.reshape(-1), b.reshape(-1)) and np.array_equal(a, c)
        print(f"{qtype.name:5s} gpt2port {ours:.3f} s | package as called before {before:.3f} s "
              f"({before / ours:.1f}x) | package on whole rows {whole:.3f} s ({whole / ours:.1f}x) | "
              f"bytes {'equal' if same else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
