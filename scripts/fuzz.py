"""Fuzz gpt2port's readers: mutate a tiny valid file of every format at random and check that each result is either
accepted or refused in one line naming the file, within a memory bound and a time limit, with the source untouched.

    python -m scripts.fuzz                               # 300 cases, seed 0, every format
    python -m scripts.fuzz --cases 40 --seed 3 --formats gguf,tf --json fuzz.json --keep failures/

Seeds: scripts/hostile_files.py (safetensors, shards + index, pytorch pickle, nanoGPT ckpt.pt, TF bundle, llm.c .bin,
GGUF, gpt2port checkpoint with config.json/manifest.json). Each case copies one seed, applies one mutation, seeded by
(--seed, case number), to one of its files, and runs `convert SRC --out OUT` (and `info` on a gpt2port checkpoint, and
`generate` with --generate).
Mutations: truncation, bit flips, huge or negative integers written over a count or length (the GGUF seed says
where its counts are; elsewhere aligned words in the file's structured head), bytes inserted or deleted, garbage
appended; JSON files get a hostile value at a random key (0, -4, 2.5, NaN, 10**5000, 100k-deep nesting, wrong types)
or a deleted key; the TF index gets entries and header re-encoded with a hostile field and valid checksums; a
safetensors header gets a JSON mutation with its length fixed up.

Ownership cases (--ownership, by default a fifth of --cases, ownership_case below) build what a user keeps next to
or inside a gpt2port output: a file of theirs at any depth (tokens/, train_state/, .checkpoint/, a build directory),
a directory under a name gpt2port writes as a file, a FIFO or a link under such a name, marks that do not check out
(a tokens/meta.json whose counts miss its files, a manifest recording another size or listing a foreign name, a
stage mark naming another directory), a file gpt2port wrote edited in place at its size (its modification time set
back: only its content tells), and look-alike .out.partial-PID / .out.replaced-PID siblings; then run
`convert SRC --out OUT --force`. A failure is also any of the user's files removed or changed.

Each command runs in a child forked from one worker process that has imported gpt2port (a fresh interpreter per case
would cost seconds), under RLIMIT_AS (--memory, 2 GB) and --timeout. A failure is: a traceback or "internal error",
a refusal that is not one line starting "error: " and naming a path in the case, a hang, a peak RSS over the worker's
by more than --rss, death by a signal, or any change to the source's bytes. Exit status 1 if any case failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts import ROOT, fuzz_state, hostile_files
from scripts.fuzz_inputs import Adapter, EvalData
from scripts.fuzz_mutate import MUTATORS

GB = 1 << 30
# formats that bring their own seed, mutations, commands and judge
GENERATORS = {fuzz_state.NAME: fuzz_state, EvalData.NAME: EvalData, Adapter.NAME: Adapter}


# --- the worker: one process with gpt2port imported, forking a child per command ---------------------------------

def worker() -> None:
    import resource
    import signal
    import traceback

    import gpt2port.cli
    import gpt2port.conversion  # everything a command imports lazily, imported once here
    import gpt2port.readers.gguf
    import gpt2port.targets.gguf
    import gpt2port.readers.openai_tf
    import gpt2port.info
    import gpt2port.training.finetune

    channel = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        job = json.loads(line)
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            code = 70
            try:
                resource.setrlimit(resource.RLIMIT_AS, (job["memory"], job["memory"]))
                for fd, name in ((1, "stdout"), (2, "stderr")):
                    out = os.open(job[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    os.dup2(out, fd)
                    os.close(out)
                os.chdir(job["cwd"])
                gpt2port.cli.main(job["args"], prog_name="gpt2port")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:  # noqa: BLE001 - what escapes main() is exactly what the fuzzer looks for
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        timed_out = False
        while True:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() - t0 > job["timeout"]:
                os.kill(pid, signal.SIGKILL)
                _, status, usage = os.wait4(pid, 0)
                timed_out = True
                break
            time.sleep(0.005)
        channel.write(json.dumps({
            "rc": os.waitstatus_to_exitcode(status), "timed_out": timed_out, "seconds": time.monotonic() - t0,
            "maxrss": usage.ru_maxrss * 1024, "base_rss": _rss(),
        }) + "\n")
        channel.flush()


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class Worker:
    def __init__(self):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
        self.proc = subprocess.Popen([sys.executable, "-m", "scripts.fuzz", "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)

    def run(self, args: list[str], cwd: Path, memory: int, timeout: float) -> dict:
        out, err = cwd.parent / f".{cwd.name}-stdout", cwd.parent / f".{cwd.name}-stderr"
        self.proc.stdin.write(json.dumps({"args": [str(a) for a in args], "cwd": str(cwd), "memory": memory,
                                          "timeout": timeout, "stdout": str(out), "stderr": str(err)}) + "\n")
        self.proc.stdin.flush()
        result = json.loads(self.proc.stdout.readline())
        result["stdout"], result["stderr"] = out.read_text(errors="replace"), err.read_text(errors="replace")
        out.unlink()
        err.unlink()
        return result

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


# --- judging ---------------------------------------------------------------------------------------------------------

def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def judge(result: dict, case_dir: Path, rss_bound: int) -> str | None:
    """Why this run failed, or None."""
    text = result["stdout"] + result["stderr"]
    if result["timed_out"]:
        return "hang"
    if result["rc"] < 0:
        return f"killed by signal {-result['rc']}"
    if "Traceback" in text or "internal error" in text:
        return "internal error"
    if result["maxrss"] - result["base_rss"] > rss_bound:
        return f"memory: peak RSS {result['maxrss'] / 1e9:.2f} GB"
    if result["rc"] != 0:
        lines = result["stderr"].strip().splitlines()
        if len(lines) != 1 or not lines[0].startswith("error: "):
            return "not a one-line refusal"
        if str(case_dir) not in lines[0]:
            return "refusal does not name the file"
    return None


# --- the run ---------------------------------------------------------------------------------------------------------

def commands(fmt: str, src: Path, out: Path, generate: bool = False) -> list[list]:
    if fmt == "gpt2port":
        return [["info", src], ["convert", src, "--out", out]] + \
            ([["generate", src, "hi", "-n", "2", "--seed", "0", "--device", "cpu"]] if generate else [])
    return [["convert", src, "--out", out]]


# --- ownership: what --force must leave alone ---------------------------------------------------------------------

def ownership_case(rng: random.Random, case_dir: Path, checkpoint: Path) -> tuple[list, dict[Path, tuple]]:
    """A gpt2port checkpoint at case_dir/out with one thing of a user's planted in or beside it (see the module
    docstring), and the command to run; returns (args, what must survive: path -> state())."""
    src, out = case_dir / "src", case_dir / "out"
    shutil.copytree(checkpoint, src)
    shutil.copytree(checkpoint, out)
    kind = rng.choice(["nested file", "directory under a file name", "forged tokens mark", "manifest size",
                       "manifest lists a foreign name", "stage mark of another", "sibling look-alike",
                       "special file", "link", "edited in place"])
    mine = b"the user's own bytes " + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    planted: list[Path] = []

    def plant(path: Path, data: bytes = mine) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        planted.append(path)
        return path

    if kind == "nested file":
        where = rng.choice(["", "tokens/", "train_state/", ".checkpoint/", ".train_state.partial/",
                            ".tokens.partial-4194305/", "..checkpoint.partial-4194305/", "deep/er/"])
        plant(out / where / rng.choice(["notes.txt", "train.bin", "meta.json", "rng-0.pt", "loss.svg", "x.distcp"]))
    elif kind == "directory under a file name":
        name = rng.choice(["config.json", "model.safetensors", "manifest.json", "vocab.json", "merges.txt"])
        (out / name).unlink(missing_ok=True)
        plant(out / name / "thesis.tex")
    elif kind == "forged tokens mark":
        n_train, n_val, width = rng.randrange(0, 1000), rng.randrange(0, 100), rng.choice([2, 4])
        meta = {"format": "gpt2port-tokens/1", "dtype": {2: "uint16", 4: "uint32"}[width], "n_train": n_train,
                "n_val": n_val}
        (out / "tokens").mkdir()
        (out / "tokens" / "meta.json").write_text(json.dumps(meta))
        plant(out / "tokens" / "train.bin", b"\0" * (n_train * width + rng.randrange(1, 9)))
        plant(out / "tokens" / "val.bin", b"\0" * (n_val * width))
    elif kind in ("manifest size", "manifest lists a foreign name"):
        manifest = json.loads((out / "manifest.json").read_text())
        if kind == "manifest size":
            manifest["files"]["model.safetensors"]["size"] += rng.choice([-1, 1]) * rng.randrange(1, 4096)
            planted.append(out / "model.safetensors")  # no longer what gpt2port wrote: the user's
        else:  # sealed again, as a forger would: the record still lists only names its layout writes
            from gpt2port import records

            name = rng.choice(["notes.txt", "thesis.tex", "data.csv"])
            data = plant(out / name).read_bytes()
            manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            manifest = records.sealed(manifest, manifest["files"])
        (out / "manifest.json").write_text(json.dumps(manifest))
    elif kind == "edited in place":  # the same size, the modification time set back: only the content tells
        name = rng.choice(sorted(json.loads((out / "manifest.json").read_text())["files"]))
        path, st = out / name, (out / name).stat()
        data = bytearray(path.read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        with open(path, "r+b") as f:
            f.write(data)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        planted.append(path)
    elif kind == "stage mark of another":
        stage = out / f".{rng.choice(['x', 'tokens', 'out'])}.partial-{rng.randrange(1, 10 ** 6)}"
        stage.mkdir()
        (stage / ".gpt2port-stage.json").write_text(json.dumps({"tool": "gpt2port", "stage": ".other.partial-1"}))
        plant(stage / rng.choice(["model.safetensors", "notes.txt"]))
    elif kind == "sibling look-alike":
        sibling = case_dir / f".out{rng.choice(['.partial-', '.replaced-'])}{rng.randrange(4194305, 2 ** 31)}"
        plant(sibling / rng.choice(["model.safetensors", "notes.txt", "config.json"]))
    elif kind == "special file":
        name = rng.choice(["model.gguf", "vocab.json", "notes.txt", "train_log.jsonl"])
        (out / name).unlink(missing_ok=True)
        os.mkfifo(out / name)
        planted.append(out / name)
    else:
        target = plant(case_dir / "elsewhere" / "private.txt")
        name = rng.choice(["vocab.json", "merges.txt", "tokens", "notes.txt"])
        if (out / name).exists():
            (out / name).unlink()
        (out / name).symlink_to(target)
        planted.append(out / name)
    return ["convert", src, "--out", out, "--force"], {p: state(p) for p in planted}


def state(p: Path) -> tuple:
    """What a planted path is, to compare after the run: its kind and bytes, a FIFO, or a link and its target."""
    if p.is_symlink():
        return ("link", os.readlink(p))
    if p.is_fifo():
        return ("fifo",)
    return ("file", p.read_bytes()) if p.is_file() else ("missing",)


def lost(protected: dict[Path, tuple]) -> str | None:
    changed = [p for p, was in protected.items() if state(p) != was]
    return f"a user's file was removed or changed: {changed[0]}" if changed else None


def fuzz(cases: int, seed: int, formats: list[str], work: Path, memory: int, timeout: float, rss_bound: int,
         keep: Path | None, generate: bool = False, log=print, ownership: int | None = None) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    seeds = hostile_files.build(work / "seeds", [f for f in formats if f not in GENERATORS])
    seeds |= {f: GENERATORS[f].build(work / "seeds" / f) for f in formats if f in GENERATORS}
    pristine = {fmt: (p if p.is_dir() else p.parent) for fmt, p in seeds.items()}
    worker = Worker()
    failures, counts, runs, t0 = [], {}, 0, time.perf_counter()
    outcomes = {"accepted": 0, "refused": 0}
    try:
        for i in range(cases):
            fmt = formats[i % len(formats)]
            rng = random.Random(f"{seed}:{i}")
            case_dir = work / f"case-{i}"
            shutil.copytree(pristine[fmt], case_dir)
            src = case_dir / seeds[fmt].relative_to(pristine[fmt]) if not seeds[fmt].is_dir() else case_dir
            own = GENERATORS.get(fmt)
            if own is not None:  # a format with its own mutations, commands and judge
                label, kind, what = own.mutate(case_dir, rng)
            else:
                target = rng.choice(sorted(p for p in case_dir.iterdir() if p.is_file() and p.suffix != ".txt"
                                           and p.name not in ("vocab.json", "merges.txt")))
                kinds = [k for k, (applies, _, _) in MUTATORS.items() if applies(target)]
                kind = rng.choices(kinds, [MUTATORS[k][2] for k in kinds])[0]
                what = MUTATORS[kind][1](target, rng)
                label = target.name
            before = files_of(case_dir)
            counts[fmt] = counts.get(fmt, 0) + 1
            runs_of = own.commands(case_dir, seeds[fmt]) if own else commands(fmt, src, work / f"out-{i}", generate)
            for args in runs_of:
                result = worker.run(args, case_dir, memory, timeout)
                runs += 1
                outcomes["accepted" if result["rc"] == 0 else "refused"] += 1
                why = judge(result, case_dir, rss_bound)
                if why is None and own is not None:
                    why = own.judge(case_dir, result, before, files_of(case_dir))
                elif why is None and files_of(case_dir) != before:
                    why = "the source changed"
                if why is not None:
                    failures.append({"case": i, "format": fmt, "file": label, "mutation": f"{kind}: {what}",
                                     "command": " ".join(map(str, args[:1])), "why": why, "rc": result["rc"],
                                     "output": (result["stderr"] or result["stdout"])[-600:]})
                    log(f"FAIL case {i} {fmt} {label} {kind}: {what}: {why}\n    "
                        f"{(result['stderr'] or result['stdout']).strip()[-300:]}")
                    if keep is not None:
                        shutil.copytree(case_dir, keep / f"case-{i}", dirs_exist_ok=True)
                shutil.rmtree(work / f"out-{i}", ignore_errors=True)
            shutil.rmtree(case_dir)
        for i in range(cases // 5 if ownership is None else ownership):
            if "gpt2port" not in seeds:
                break
            rng = random.Random(f"{seed}:ownership:{i}")
            case_dir = work / f"ownership-{i}"
            case_dir.mkdir()
            args, protected = ownership_case(rng, case_dir, pristine["gpt2port"])
            counts["ownership"] = counts.get("ownership", 0) + 1
            before = files_of(case_dir / "src")
            result = worker.run(args, case_dir, memory, timeout)
            runs += 1
            outcomes["accepted" if result["rc"] == 0 else "refused"] += 1
            why = judge(result, case_dir, rss_bound) or lost(protected)
            if why is None and files_of(case_dir / "src") != before:
                why = "the source changed"
            if why is not None:
                failures.append({"case": f"ownership-{i}", "format": "ownership", "file": "",
                                 "mutation": ", ".join(str(p.relative_to(case_dir)) for p in protected),
                                 "command": "convert --force", "why": why, "rc": result["rc"],
                                 "output": (result["stderr"] or result["stdout"])[-600:]})
                log(f"FAIL ownership-{i}: {why}\n    {(result['stderr'] or result['stdout']).strip()[-300:]}")
                if keep is not None:
                    shutil.copytree(case_dir, keep / f"ownership-{i}", dirs_exist_ok=True, symlinks=True)
            subprocess.run(["rm", "-rf", str(case_dir)], check=False)  # FIFOs and links included, never followed
    finally:
        worker.close()
    return {"cases": cases, "runs": runs, **outcomes, "seed": seed, "formats": counts, "failures": failures,
            "seconds": round(time.perf_counter() - t0, 1), "memory_cap": memory, "timeout": timeout}


def main() -> None:
    if sys.argv[1:] == ["--worker"]:
        return worker()
    FORMATS = (*hostile_files.FORMATS, *GENERATORS)  # every format the fuzzer knows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    ap.add_argument("--memory", type=float, default=2.0, help="RLIMIT_AS of each run, GB")
    ap.add_argument("--rss", type=float, default=1.0, help="peak RSS growth allowed over the worker's, GB")
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per run")
    ap.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new temporary one)")
    ap.add_argument("--keep", type=Path, default=None, help="copy each failing case here")
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    ap.add_argument("--generate", action="store_true", help="also run `generate` on each gpt2port checkpoint")
    ap.add_argument("--ownership", type=int, default=None,
                    help="ownership cases (what --force must leave alone), after the format cases (default: a "
                         "fifth of --cases)")
    a = ap.parse_args()
    formats = a.formats.split(",")
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        ap.error(f"unknown format(s) {', '.join(unknown)}")
    work = a.work or Path(tempfile.mkdtemp(prefix="gpt2port-fuzz-"))
    try:
        report = fuzz(a.cases, a.seed, formats, work, int(a.memory * GB), a.timeout, int(a.rss * GB), a.keep,
                      a.generate, ownership=a.ownership)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        a.json.write_text(json.dumps(report, indent=2))
    print(f"{report['cases']} cases ({report['runs']} runs: {report['accepted']} accepted, "
          f"{report['refused']} refused) over {len(report['formats'])} formats "
          f"({', '.join(f'{k} {v}' for k, v in report['formats'].items())}) in {report['seconds']} s, seed "
          f"{report['seed']}: {len(report['failures'])} failures")
    sys.exit(1 if report["failures"] else 0)


if __name__ == "__main__":
    main()
