"""`gpt2port ARGS...` (an `export --to onnx`) in this process, with the peak RSS of each step of the export printed to
stderr: where the memory goes.

    python -m scripts.bench.onnx_phases export CKPT --to onnx --out DIR [--dtype fp16]

A thread samples VmRSS (/proc/self/status) every 0.1 s; the export's steps are marked by wrapping the functions that
do them (reading the weights, torch.export, its decomposition, the translation to ONNX, onnxscript's optimizer, the
save, the proof), so each line is the largest RSS seen from the step's start to its end, and the RSS it ended at.
With --rss-limit GB the process ends (exit 9) when its RSS passes that, naming the step, before the machine runs out.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time

_now = {"step": "start", "peak": 0, "wall": time.perf_counter(), "cpu": time.process_time()}


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _sample(limit_kib: int | None) -> None:
    while True:
        rss = rss_kib()
        _now["peak"] = max(_now["peak"], rss)
        if limit_kib and rss > limit_kib:
            print(f"onnx_phases: RSS {rss / 1024**2:.2f} GB past the limit in step {_now['step']!r}", file=sys.stderr,
                  flush=True)
            os._exit(9)
        time.sleep(0.1)


def _mark(step: str) -> None:
    rss = rss_kib()
    _now["peak"] = max(_now["peak"], rss)
    print(f"phase {_now['step']:<22} to {time.perf_counter() - _now['wall']:7.1f} s wall "
          f"({time.process_time() - _now['cpu']:7.1f} CPU s): peak {_now['peak'] / 1024**2:6.2f} GB, "
          f"ends at {rss / 1024**2:6.2f} GB", file=sys.stderr, flush=True)
    _now.update(step=step, peak=rss)


def _wrap(owner, attr: str, step: str) -> None:
    inner = getattr(owner, attr)

    @functools.wraps(inner)
    def marked(*args, **kwargs):
        before = _now["step"]
        _mark(step)
        try:
            return inner(*args, **kwargs)
        finally:
            _mark(before)  # back in the step that called it

    setattr(owner, attr, marked)


def main() -> None:
    args = sys.argv[1:]
    limit = None
    if "--rss-limit" in args:
        i = args.index("--rss-limit")
        limit = int(float(args[i + 1]) * 1024**2)
        del args[i:i + 2]
    threading.Thread(target=_sample, args=(limit,), daemon=True).start()
    import torch.export
    from torch.onnx._internal.exporter import _core, _onnx_program

    from gpt2port import model
    from gpt2port.cli import main as cli
    from gpt2port.targets import onnx

    for owner, attr, step in [(onnx, "_state", "read the weights"), (model.GPT, "from_state", "build the model"),
                              (torch.export, "export", "torch.export"),
                              (_core, "_prepare_exported_program_for_export", "decompose"),
                              (_core, "_exported_program_to_onnx_program", "translate to ONNX"),
                              (_onnx_program.ONNXProgram, "optimize", "optimize"),
                              (_onnx_program.ONNXProgram, "save", "save"), (onnx, "prove", "proof")]:
        _wrap(owner, attr, step)
    try:
        cli(args, standalone_mode=False)
    finally:
        _mark("end")


if __name__ == "__main__":
    main()
