"""Prove an llm.c export with llm.c itself: build its CPU test_gpt2, export a checkpoint with --debug-state, and run
test_gpt2 on it. test_gpt2 runs llm.c's C forward and backward on the debug state's batch and compares the logits,
the loss and all 16 parameter gradients with what gpt2port's model computed.

Usage, from the repository root:
    python -m scripts.check_llmc --llmc PATH/TO/llm.c CKPT [--work DIR]

PATH/TO/llm.c is a checkout of karpathy/llm.c (only read: test_gpt2 is built in the work directory). CKPT is a
gpt2port checkpoint of any size; test_gpt2 opens fixed names (gpt2_124M.bin, ...), so the files are linked under
them. Exits 0 when the logits, the loss and every gradient are OK. The training steps test_gpt2 runs afterwards
compare against losses recorded for the real GPT-2 weights on llm.c's own batch, so they are printed, not judged.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# test_gpt2.c's names for the files it opens from its working directory.
TEST_FILES = {"model": "gpt2_124M.bin", "state": "gpt2_124M_debug_state.bin", "tokenizer": "gpt2_tokenizer.bin"}
GRADIENTS = 16


@dataclass
class Result:
    logits: str = ""  # test_gpt2's line about them
    loss: str = ""
    gradients: list[tuple[str, str]] = field(default_factory=list)  # (tensor, verdict line)
    output: str = ""

    @property
    def ok(self) -> bool:
        return (self.logits.startswith("OK") and self.loss.startswith("LOSS OK") and len(self.gradients) == GRADIENTS
                and all(v.startswith("TENSOR OK") for _, v in self.gradients))


def build(llmc: Path, work: Path) -> Path:
    """test_gpt2 compiled as llm.c's Makefile does for the CPU, into `work` (the checkout is not written)."""
    exe = work / "test_gpt2"
    cmd = ["gcc", "-O3", "-fopenmp", str(llmc / "test_gpt2.c"), "-lm", "-o", str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: building test_gpt2 failed: {' '.join(cmd)}\n{done.stderr}")
    return exe


def export(ckpt: Path, out: Path) -> None:
    from gpt2port import export as run_export

    run_export(ckpt, out, to="llmc", dtype="fp32", options={"debug_state": True})


def parse(output: str) -> Result:
    r = Result(output=output)
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if "(LOGITS)" in line:
            r.logits = line.strip()
        elif line.startswith(("LOSS OK", "LOSS MISMATCH")):
            r.loss = line.strip()
        elif line.startswith(("TENSOR OK", "TENSOR NOT OK")):
            label = next(lines[j] for j in range(i - 1, -1, -1) if lines[j].startswith("d"))
            r.gradients.append((label.strip(), line.strip()))
    return r


def check(llmc: Path, ckpt: Path, work: Path) -> Result:
    exe = build(llmc, work)
    out = work / "export"
    export(ckpt, out)
    names = {p.name: p for p in out.iterdir()}
    model = next(p for n, p in names.items() if n.endswith(".bin") and "debug_state" not in n and "tokenizer" not in n)
    state = next(p for n, p in names.items() if n.endswith("_debug_state.bin"))
    run = work / "run"
    run.mkdir()
    for role, path in (("model", model), ("state", state), ("tokenizer", out / TEST_FILES["tokenizer"])):
        os.symlink(path, run / TEST_FILES[role])
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))}
    done = subprocess.run([str(exe)], cwd=run, capture_output=True, text=True, env=env)
    result = parse(done.stdout + done.stderr)
    if done.returncode != 0 and not result.logits:
        sys.exit(f"error: test_gpt2 exited {done.returncode}:\n{result.output}")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", type=Path, help="a gpt2port checkpoint directory")
    ap.add_argument("--llmc", type=Path, required=True, help="a checkout of karpathy/llm.c")
    ap.add_argument("--work", type=Path, default=None, help="where to build and run (default: a temporary dir)")
    ap.add_argument("--verbose", action="store_true", help="print test_gpt2's whole output")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpt2port-check-llmc-"))
    try:
        work.mkdir(parents=True, exist_ok=True)
        result = check(args.llmc, args.ckpt, work)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(result.output if args.verbose else "\n".join(
        [result.logits, result.loss] + [f"{name}: {verdict}" for name, verdict in result.gradients]
        + [line for line in result.output.splitlines() if re.match(r"step \d+:|overall okay", line)]))
    print(f"llm.c test_gpt2: logits, loss and {GRADIENTS} gradients {'OK' if result.ok else 'NOT OK'}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
