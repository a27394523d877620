"""`gpt2port eval` under torchrun, two processes on the CPU (gloo): the batches dealt over the ranks, the figures
those of one process, printed once. Each batch is the one process's own, so every figure is equal exactly, the
perplexities too (their sums are added in the same order)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

from tests.support import ROOT, run_cli


# Loaded by every rank's interpreter (sitecustomize): on the second rank only, scoring fails at once, as a rank
# that runs out of memory alone would.
FAIL_SECOND_RANK = """
import os
if os.environ.get("RANK") == "1":
    from gpt2port.evaluation import choices

    def score(*args, **kwargs):
        raise MemoryError("the second rank alone")

    choices.score = score
"""


def torchrun(*args, site=None, timeout=600) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 -m gpt2port eval ARGS` run to its end (`site`: a sitecustomize's source)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "gpt2port", "eval", *args]
    with tempfile.TemporaryDirectory(prefix="torchrun-") as tmp:  # torchrun's own torchelastic_* directories
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": tmp}
        if site is not None:
            with open(os.path.join(tmp, "sitecustomize.py"), "w") as f:
                f.write(site)
            env["PYTHONPATH"] = os.pathsep.join([tmp, str(ROOT), env.get("PYTHONPATH", "")])
        return subprocess.run(list(map(str, cmd)), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env=env)


def torchrun_eval(*args) -> tuple[str, str]:
    """(stdout, stderr) of `torchrun --nproc-per-node 2 -m gpt2port eval ARGS`, which must succeed."""
    r = torchrun(*args)
    assert r.returncode == 0, r.stderr[-20000:]
    return r.stdout, r.stderr


# hellaswag: a rehearsal (lambada's path: choices.score, the same dealing in ranks.py)
@pytest.mark.parametrize("task", ["perplexity", "lambada", pytest.param("hellaswag", marks=pytest.mark.rehearsal)])
def test_two_ranks_give_one_process_figures(realistic, tuned_hf, text_file, lambada_file, hellaswag_file, task,
                                           one_thread):
    """Each process on one thread, as each rank (a matrix product split over threads may add in another order)."""
    _, ckpt = realistic
    args = {"perplexity": ["--data", text_file, "--against", tuned_hf, "--stride", "16"],
            "lambada": ["--data", lambada_file], "hellaswag": ["--data", hellaswag_file]}[task]
    args = [ckpt, "--task", task, *args, "--batch-tokens", "256", "--json", "-q"]
    alone = run_cli("eval", *args)
    assert alone.exit_code == 0, alone.output
    expected = json.loads(alone.stdout)
    out, _ = torchrun_eval(*args)
    got = json.loads(out)  # one JSON document: the second rank printed nothing
    assert got.pop("ranks") == 2
    for found in (got, expected):
        found.pop("seconds")
    assert got == expected


def test_a_rank_failing_alone_ends_the_run_at_once(realistic, lambada_file):
    """The other rank is not left waiting for the failed one's results (in the gather, until the process group's
    30-minute timeout): torchrun ends it, the failure is said in one line, and no figures are printed."""
    _, ckpt = realistic
    t = time.monotonic()
    r = torchrun(ckpt, "--task", "lambada", "--data", lambada_file, "--json", "-q", site=FAIL_SECOND_RANK,
                 timeout=300)
    assert time.monotonic() - t < 120
    assert r.returncode != 0
    assert r.stdout == ""
    said = [line for line in r.stderr.splitlines() if line.startswith("error: gpt2port eval: out of memory")]
    assert len(said) == 1, r.stderr[-5000:]
