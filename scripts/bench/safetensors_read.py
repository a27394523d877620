"""Benchmark: gpt2port's safetensors reader against the safetensors library's `safe_open(..., backend="pread")`,
side by side, on the same random-weight checkpoint, each run in a fresh process (its own peak RSS), alternating.

Two measures, each for both readers:
  read     every tensor of model.safetensors read once (gpt2port: SafetensorsReader.read into one reused buffer;
           library: safe_open(path, "pt", backend="pread").get_tensor, a fresh tensor each)      wall, peak RSS
  convert  gpt2port.convert(SRC, OUT) with the ".safetensors" row of readers.READERS as it is, or replaced by a
           reader whose read() is the library's get_tensor (the rest of the conversion unchanged: the same
           writer, the same source hash, which then reads the file itself)                      wall, peak RSS
  reference  what the float64 reference (verification/reference.py) does with each tensor, get_tensor then a float64
           copy, through the library both ways: the mmap backend opened afresh for each tensor (so that no page
           stays mapped), or one pread handle for the file (--measures reference; READER is then
           "safe_open-mmap" or "safe_open-pread")                                                   wall, peak RSS
The machine's load average is printed with each figure: on a shared machine compare rounds, not single runs.

    python -m scripts.bench.safetensors_read [--size gpt2] [--workdir /tmp/gpt2port-bench-st] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from scripts import ROOT

READERS = ("gpt2port", "safe_open-pread")
REFERENCE = ("safe_open-mmap", "safe_open-pread")


def library_reader(path: Path):
    """A gpt2port Reader whose tensors come from the safetensors library (pread backend); header from gpt2port's
    parser (names, dtypes, offsets: the conversion plans with them), bytes from the library."""
    from safetensors import safe_open

    from gpt2port.formats.base import Reader
    from gpt2port.formats.safetensors import SafetensorsReader

    class LibraryReader(SafetensorsReader):
        def __init__(self, path):
            super().__init__(path)
            self._file = safe_open(str(path), framework="pt", backend="pread")

        def read(self, name, into=None):
            return self._file.get_tensor(name)

        stream = Reader.stream  # none: the library reads a tensor whole only

    return LibraryReader(path)


def child(measure: str, reader: str, src: Path, out: Path) -> dict:
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    if measure == "read":
        path = src / "model.safetensors"
        total = 0
        if reader == "gpt2port":
            from gpt2port.formats.safetensors import SafetensorsReader

            r = SafetensorsReader(path)
            buffer = torch.empty(r.largest(), dtype=torch.uint8)
            for name in r.tensors:
                total += r.read(name, into=buffer).numel()
        else:
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", backend="pread") as f:
                for name in f.offset_keys():
                    total += f.get_tensor(name).numel()
    elif measure == "reference":
        from safetensors import safe_open

        path = str(src / "model.safetensors")
        with safe_open(path, framework="pt") as f:
            keys = list(f.keys())
        if reader == "safe_open-mmap":
            for key in keys:
                with safe_open(path, framework="pt") as f:
                    f.get_tensor(key).to(torch.float64, copy=True)
        else:
            with safe_open(path, framework="pt", backend="pread") as f:
                for key in keys:
                    f.get_tensor(key).to(torch.float64, copy=True)
    else:
        from gpt2port import convert, readers

        if reader != "gpt2port":
            readers.READERS[".safetensors"] = library_reader
        convert(src, out, force=True)
    wall = time.perf_counter() - t0
    return {"inner_s": wall, "peak_rss_gb": _vm_hwm_kib() * 1024 / 1e9}


def _vm_hwm_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise SystemExit("no VmHWM in /proc/self/status")


def run_child(measure: str, reader: str, src: Path, out: Path) -> dict:
    load = os.getloadavg()[0]
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.safetensors_read", "--child", measure, reader,
                           str(src), str(out)], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{measure} {reader} failed:\n{proc.stderr[-3000:]}")
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"measure": measure, "reader": reader, **facts, "load_before": load, "load_after": os.getloadavg()[0]}


def _same_weights(a: Path, b: Path) -> bool:
    """The two outputs' weights, byte for byte (the manifests differ only in what they say of the run)."""
    with open(a / "model.safetensors", "rb") as fa, open(b / "model.safetensors", "rb") as fb:
        while True:
            x, y = fa.read(64 << 20), fb.read(64 << 20)
            if x != y:
                return False
            if not x:
                return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="gpt2")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gpt2port-bench-st"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--measures", default="read,convert")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--child", nargs=4, metavar=("MEASURE", "READER", "SRC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        measure, reader, src, out = args.child
        print(json.dumps(child(measure, reader, Path(src), Path(out))))
        return
    work = args.workdir / args.size
    src = work / "hf"
    if not (src / "model.safetensors").exists():
        subprocess.run([sys.executable, "-m", "scripts.hf_fixtures", str(src), "--size", args.size, "--layout", "hub",
                        "--streamed"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    size_gb = (src / "model.safetensors").stat().st_size / 1e9
    with open(src / "model.safetensors", "rb") as f:  # page cache warm: both readers start alike
        while f.read(64 << 20):
            pass
    print(f"# {args.size}: model.safetensors {size_gb:.2f} GB, {os.cpu_count()} CPUs")
    print(f"{'measure':8} {'reader':16} {'wall s':>7} {'peak RSS GB':>11}  load avg (before, after)")
    rows = []
    try:
        for _ in range(args.rounds):
            for measure in args.measures.split(","):
                for reader in (REFERENCE if measure == "reference" else READERS):
                    out = work / f"out-{reader}"
                    shutil.rmtree(out, ignore_errors=True)
                    os.sync()  # no run pays for the previous one's write-back
                    r = run_child(measure, reader, src, out)
                    rows.append(r)
                    print(f"{measure:8} {reader:16} {r['inner_s']:7.2f} {r['peak_rss_gb']:11.2f}  "
                          f"{r['load_before']:.2f}, {r['load_after']:.2f}", flush=True)
                if measure == "convert" and not _same_weights(*(work / f"out-{r}" for r in READERS)):
                    raise SystemExit("the two conversions wrote different weights")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for measure in args.measures.split(","):
        for reader in (REFERENCE if measure == "reference" else READERS):
            mine = [r for r in rows if r["measure"] == measure and r["reader"] == reader]
            print(f"best {measure:8} {reader:16} {min(r['inner_s'] for r in mine):7.2f} s  "
                  f"{min(r['peak_rss_gb'] for r in mine):.2f} GB")


if __name__ == "__main__":
    main()
