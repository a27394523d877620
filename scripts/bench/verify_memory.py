"""Peak resident memory of a command and the progress line it had printed when the peak fell (its phase), plus the
longest silence between two of its stderr lines: the numbers behind `verify --grads --no-hf`'s memory and
progress claims (docs/verify.md).

The command runs as a child; every `--period` seconds (default 0.05) the VmRSS of it and of all its descendants is
read from /proc and summed; its stderr is read line by line as it comes, each line stamped. Out: the peak (GB), when,
the last stderr line before it, the peak of each phase (a phase: the stderr line with its numbers dropped, so
"block 3/12" and "block 4/12" are one), the longest gap between stderr lines (overall and after `--gaps-from`),
the child's CPU seconds and its own ru_maxrss.

Usage (from the repository root):
    python -m scripts.bench.verify_memory -- python -m gpt2port verify /work/bench/gpt2-gpt2port --no-hf --grads
    python -m scripts.bench.verify_memory --gaps-from gradients --json-out m.json -- CMD ARGS...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

GB = 1024**3
_NUMBERS = re.compile(r"\d+(\.\d+)?")
_ELAPSED = re.compile(r"^\S+ \[\s*\d+s\] ")  # StatusLine's "verify [  12s] " prefix


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after the comm field, which may hold spaces
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def stopped(pid: int) -> bool:
    """Whether pid is stopped (SIGSTOP): on a shared machine another job may pause it, and a pause is no silence of
    the command's own."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "Tt"
    except OSError:
        return False


def tree_rss(pid: int) -> int:
    """VmRSS in bytes of pid and every descendant (0 for those gone meanwhile)."""
    kids, todo, total = _children(), [pid], 0
    while todo:
        p = todo.pop()
        todo += kids.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            pass
    return total


def phase_of(line: str) -> str:
    return _NUMBERS.sub("N", _ELAPSED.sub("", line)).strip()


def measure(cmd: list[str], period: float = 0.05, echo: bool = False) -> dict:
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines: list[tuple[float, str]] = []
    out: list[bytes] = []
    samples: list[tuple[float, int]] = []
    paused: list[float] = []  # times (one per period) at which the child, or this sampler with it, was stopped
    done = threading.Event()

    def read_err() -> None:
        for raw in child.stderr:
            text = raw.decode(errors="replace").rstrip("\n")
            lines.append((time.perf_counter() - t0, text))
            if echo:
                print(f"[{lines[-1][0]:7.1f}s {samples[-1][1] / GB if samples else 0:5.2f} GB] {text}",
                      file=sys.stderr, flush=True)

    def sample() -> None:
        last = 0.0
        while not done.wait(period):
            now = time.perf_counter() - t0
            if now - last > 10 * period:  # this sampler was stopped too (a job stopping every process, as a timing
                paused.extend(last + period * (k + 1) for k in range(int((now - last) / period) - 1))  # run does)
            samples.append((now, tree_rss(child.pid)))
            if stopped(child.pid):
                paused.append(now)
            last = now

    threads = [threading.Thread(target=read_err, daemon=True), threading.Thread(target=sample, daemon=True),
               threading.Thread(target=lambda: out.append(child.stdout.read()), daemon=True)]
    for t in threads:
        t.start()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - t0
    done.set()
    for t in threads:
        t.join()
    child.returncode = os.waitstatus_to_exitcode(status)
    r = summarize(cmd, child.returncode, wall, usage, samples, lines, out[0].decode(errors="replace"))
    return {**r, "paused": paused, "period": period}


def summarize(cmd, code, wall, usage, samples, lines, stdout) -> dict:
    def line_before(t: float) -> str:
        before = [text for at, text in lines if at <= t]
        return before[-1] if before else "(before the first stderr line)"

    peak_t, peak = max(samples, key=lambda s: s[1]) if samples else (0.0, 0)
    phases: dict[str, dict] = {}
    for at, rss in samples:
        p = phase_of(line_before(at))
        if p not in phases or rss > phases[p]["peak_gb"] * GB:
            phases[p] = {"peak_gb": rss / GB, "at_s": at}
    return {"cmd": cmd, "exit": code, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "ru_maxrss_gb": usage.ru_maxrss * 1024 / GB, "peak_gb": peak / GB, "peak_at_s": peak_t,
            "peak_phase": line_before(peak_t), "phases": phases, "samples": len(samples),
            "lines": lines, "stdout_tail": stdout[-2000:]}


def gaps(lines: list[tuple[float, str]], wall: float, start: str | None = None, paused=(), period=0.05) -> dict:
    """The longest silence between stderr lines (from the first line containing `start`, if given, to the end),
    less the time the child spent stopped (each period found stopped, or missed by a stopped sampler, counts)."""
    stamps = [(at, text) for at, text in lines]
    if start is not None:
        first = next((i for i, (_, text) in enumerate(stamps) if start in text), None)
        stamps = stamps[first:] if first is not None else []
    if not stamps:
        return {"max_gap_s": None, "after": None}
    worst = (0.0, None)
    for (a, text), (b, _) in zip(stamps, stamps[1:] + [(wall, "(exit)")]):
        gap = b - a - period * sum(1 for p in paused if a < p < b)
        if gap > worst[0]:
            worst = (gap, text)
    return {"max_gap_s": worst[0], "after": worst[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--period", type=float, default=0.05, help="seconds between RSS samples")
    ap.add_argument("--gaps-from", default="gradients", help="also the longest stderr silence from the first line "
                                                            "containing this")
    ap.add_argument("--echo", action="store_true", help="print each stderr line as it comes, with the time and RSS")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command and its arguments")
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("no command given (put it after --)")
    r = measure(cmd, args.period, args.echo)
    r["gaps"] = gaps(r["lines"], r["wall_s"], None, r["paused"], args.period)
    r["gaps_from"] = {"from": args.gaps_from, **gaps(r["lines"], r["wall_s"], args.gaps_from, r["paused"], args.period)}
    with open("/proc/loadavg") as f:
        r["loadavg_end"] = f.read().split()[:3]
    print(f"exit {r['exit']}; wall {r['wall_s']:.0f} s, CPU {r['cpu_s']:.0f} s; load average at the end "
          f"{' '.join(r['loadavg_end'])}")
    print(f"peak RSS {r['peak_gb']:.2f} GB (process tree, sampled every {args.period} s; the child's own ru_maxrss "
          f"{r['ru_maxrss_gb']:.2f} GB) at {r['peak_at_s']:.0f} s, during: {r['peak_phase']}")
    print("peak by phase (GB):")
    for p, v in sorted(r["phases"].items(), key=lambda kv: kv[1]["at_s"]):
        print(f"  {v['peak_gb']:5.2f}  at {v['at_s']:6.0f} s  {p}")
    g, gf = r["gaps"], r["gaps_from"]
    print(f"stopped by a signal (SIGSTOP) for about {len(r['paused']) * args.period:.0f} s of it; the silences below "
          f"leave that out")
    print(f"longest stderr silence: {g['max_gap_s'] or 0:.1f} s after {g['after']!r}")
    print(f"longest from the first {gf['from']!r} line: {gf['max_gap_s'] or 0:.1f} s after {gf['after']!r}")
    if args.json_out:
        args.json_out.write_text(json.dumps(r, indent=1))
    sys.exit(0 if r["exit"] == 0 else 1)


if __name__ == "__main__":
    main()
