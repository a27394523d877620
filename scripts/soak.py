"""Soak check: convert and verify GPT-2 sizes back to back in one process; report peak RSS per step and prove that
nothing leaked (file descriptors, memory maps, threads, temporary files, build directories).

    python -m scripts.soak                      # all four sizes (gpt2-xl needs ~13 GB free disk, ~25 min here)
    python -m scripts.soak --sizes gpt2         # 124M only (~1 min)
    python -m scripts.soak --sizes gpt2 --rounds 3 --json soak.json

Per size: a random-weight 2019-hub-layout model.safetensors at the real shape (hf_fixtures.write_random_hub_file,
one tensor in memory at a time) + config.json + the genuine tokenizer files; then `--rounds` conversions in THIS
process (gpt2port.convert, the first into a fresh directory, later ones replacing it with force=True), each
followed by the leak checks; then a verification in a child process: `gpt2port verify CKPT --reference SRC --json`.

Peak RSS: the convert steps run in this process, so the kernel's high-water mark (VmHWM) is reset before each
(/proc/self/clear_refs, 5) and read after it; the verify child's peak is its own ru_maxrss (os.wait4). Leaks are
differences against a baseline taken before the first conversion: /proc/self/fd entries, /proc/self/maps entries
naming a source or output file, live threads, new entries in the (private) temp directory, .partial-/.replaced-
directories. The verify child runs with a temp directory of its own; anything it leaves there, other than the
compile-cache directory PyTorch creates whenever transformers is imported, fails its step.
Exit status 1 if any check fails or any verification does not pass.
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

SIZES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
GB = 1e9


# --- what this process holds ------------------------------------------------------------------------------------------

def open_fds() -> dict[str, str]:
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the fd listdir itself used, already closed
            pass
    return fds


def mapped_files(under: list[Path]) -> list[str]:
    """Files under `under` that this process still has memory-mapped (a leaked map pins a deleted file's space)."""
    roots = [str(p) for p in under]
    found = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and any(parts[5].strip().startswith(r) for r in roots):
                found.add(parts[5].strip())
    return sorted(found)


def rss_now() -> int:
    return _status_kb("VmRSS") * 1024


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS, so the next peak belongs to the next step alone (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    return _status_kb("VmHWM") * 1024


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def temp_entries() -> set[str]:
    return set(os.listdir(tempfile.gettempdir()))


class Baseline:
    """What the process held before the soak started; every step is compared with it."""

    def __init__(self):
        self.fds = open_fds()
        self.threads = {t.ident for t in threading.enumerate()}
        self.temp = temp_entries()

    def leaks(self, workdir: Path, dest: Path) -> list[str]:
        found = []
        new_fds = {fd: target for fd, target in open_fds().items() if fd not in self.fds}
        if new_fds:
            found.append(f"{len(new_fds)} file descriptor(s) still open: {sorted(set(new_fds.values()))[:5]}")
        maps = mapped_files([workdir])
        if maps:
            found.append(f"still memory-mapped: {maps[:5]}")
        threads = [t.name for t in threading.enumerate() if t.ident not in self.threads and t.is_alive()]
        if threads:
            found.append(f"threads still running: {threads}")
        temp = sorted(temp_entries() - self.temp)
        if temp:
            found.append(f"new entries in {tempfile.gettempdir()}: {temp[:5]}")
        from gpt2port.fsio import OLD_MARK, PARTIAL_MARK

        stray = [p.name for p in dest.parent.iterdir() if PARTIAL_MARK in p.name or OLD_MARK in p.name]
        if stray:
            found.append(f"build directories left beside {dest}: {stray}")
        return found


# --- the steps --------------------------------------------------------------------------------------------------------

def make_source(size: str, src: Path, dtype: str) -> None:
    from scripts import hf_fixtures

    src.mkdir(parents=True)
    hf_fixtures.write_random_hub_file(src / "model.safetensors", size, dtype=dtype, seed=SIZES.index(size))
    for name, path in hf_fixtures.tokenizer_files().items():
        shutil.copyfile(path, src / name)


def convert_step(src: Path, dest: Path, force: bool) -> dict:
    from gpt2port import convert

    exact = reset_peak()
    before = rss_now()
    t0 = time.perf_counter()
    result = convert(src, dest, force=force)
    seconds = time.perf_counter() - t0
    return {"seconds": round(seconds, 2), "peak_rss_gb": round(peak_rss() / GB, 3), "rss_before_gb":
            round(before / GB, 3), "rss_after_gb": round(rss_now() / GB, 3), "peak_exact": exact,
            "bytes": result.bytes_written, "warnings": result.warnings}


def verify_step(dest: Path, src: Path, tokens: int, extra: list[str]) -> dict:
    """In a child, so transformers' memory is its own; its peak RSS comes from the kernel via wait4."""
    cmd = [sys.executable, "-m", "gpt2port", "verify", str(dest), "--reference", str(src), "--tokens", str(tokens),
           "--json", *extra]
    t0 = time.perf_counter()
    # The child gets a temp directory of its own: what it leaves there is reported below, and this process's leak
    # checks stay about this process's conversions.
    child_tmp = Path(tempfile.mkdtemp(prefix="verify-tmp-"))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, "TMPDIR": str(child_tmp)})
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    step = {"seconds": round(time.perf_counter() - t0, 2), "peak_rss_gb": round(usage.ru_maxrss * 1024 / GB, 3),
            "passed": proc.returncode == 0}
    try:
        step["verdict"] = json.loads(stdout)["verdict"]
    except (json.JSONDecodeError, KeyError):
        pass
    if proc.returncode != 0:
        step["error"] = (stderr.strip().splitlines() or stdout.strip().splitlines() or ["?"])[-1]
    # PyTorch's compile cache directory appears whenever transformers is imported (the HF reference), not ours:
    # tests/test_convert.py checks that gpt2port's own load and forward create nothing there.
    left = sorted(p.name for p in child_tmp.iterdir() if not p.name.startswith("torchinductor_"))
    shutil.rmtree(child_tmp, ignore_errors=True)
    if left:
        step["passed"] = False
        step["error"] = f"verify left files in its temp directory: {left[:5]}"
    return step


# --- the run ----------------------------------------------------------------------------------------------------------

def soak(sizes: list[str], workdir: Path, rounds: int, dtype: str, tokens: int, keep: bool,
         verify_args: list[str]) -> tuple[list[dict], bool]:
    import torch  # noqa: F401 - loaded before the baseline, so its own threads and files are not counted as leaks

    import gpt2port.conversion  # noqa: F401

    baseline = Baseline()
    rows, ok = [], True
    for size in sizes:
        src, dest = workdir / f"{size}-hf", workdir / "checkpoints" / size
        t0 = time.perf_counter()
        make_source(size, src, dtype)
        rows.append({"size": size, "step": "make source", "seconds": round(time.perf_counter() - t0, 2),
                     "bytes": (src / "model.safetensors").stat().st_size})
        src_before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in src.iterdir()}
        for r in range(rounds):
            row = {"size": size, "step": f"convert #{r + 1}" if rounds > 1 else "convert"}
            try:
                row.update(convert_step(src, dest, force=r > 0))
            except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on to the next size
                row["error"] = f"{type(e).__name__}: {e}"
            row["leaks"] = baseline.leaks(workdir, dest)
            if {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in src.iterdir()} != src_before:
                row["leaks"].append("the source changed")
            ok &= not row["leaks"] and "error" not in row
            rows.append(row)
            _print_row(rows[-1])
        if dest.exists():
            row = {"size": size, "step": "verify", **verify_step(dest, src, tokens, verify_args)}
            ok &= row["passed"]
            rows.append(row)
            _print_row(rows[-1])
        if not keep:
            shutil.rmtree(src)
            shutil.rmtree(dest, ignore_errors=True)
            left = mapped_files([workdir])
            if left:  # a map of a deleted file keeps its disk space until the process ends
                rows.append({"size": size, "step": "cleanup", "leaks": [f"deleted files still mapped: {left[:5]}"]})
                ok = False
    return rows, ok


def _print_row(row: dict) -> None:
    facts = [f"{row['seconds']:.1f}s" if "seconds" in row else "",
             f"peak RSS {row['peak_rss_gb']:.2f} GB" if "peak_rss_gb" in row else "",
             "leaks: " + "; ".join(row["leaks"]) if row.get("leaks") else ("no leaks" if "leaks" in row else ""),
             "PASS" if row.get("passed") else ("FAIL" if "passed" in row else ""),
             row.get("error", "")]
    print(f"{row['size']:<12} {row['step']:<12} " + "  ".join(f for f in facts if f), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(SIZES), help="comma-separated, from: " + ", ".join(SIZES))
    ap.add_argument("--rounds", type=int, default=2, help="conversions per size, back to back (the 2nd+ use --force)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"], help="dtype of the random sources")
    ap.add_argument("--tokens", type=int, default=64, help="length of the verification inputs")
    ap.add_argument("--verify-args", default="", help="more options for `gpt2port verify`, e.g. '--no-hf'")
    ap.add_argument("--workdir", type=Path, default=None, help="where sources and checkpoints go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep sources and checkpoints")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"unknown size(s) {unknown}; choose from {', '.join(SIZES)}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpt2port-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # A private temp dir, so other programs' temp files are not counted as ours (children inherit it).
    (workdir / "tmp").mkdir(exist_ok=True)
    os.environ["TMPDIR"] = tempfile.tempdir = str(workdir / "tmp")
    print(f"soak: {', '.join(sizes)}; {args.rounds} conversion(s) each; work in {workdir}", flush=True)
    try:
        rows, ok = soak(sizes, workdir.resolve(), args.rounds, args.dtype, args.tokens, args.keep,
                        args.verify_args.split())
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps({"ok": ok, "rows": rows}, indent=2) + "\n")
    print("soak: " + ("OK: every verification passed, nothing leaked" if ok else "FAILED (see above)"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
