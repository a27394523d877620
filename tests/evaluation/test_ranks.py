"""`gpt2port eval` under torchrun, two processes on the CPU (gloo): the batches dealt over the ranks, the figures
those of one process, printed once. Each batch is the one process's own, so every figure is equal exactly, the
perplexities too (their sums are added in the same order)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from tests.support import ROOT, run_cli


def torchrun_eval(*args) -> tuple[str, str]:
    """(stdout, stderr) of `torchrun --nproc-per-node 2 -m gpt2port eval ARGS`, which must succeed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "gpt2port", "eval", *args]
    with tempfile.TemporaryDirectory(prefix="torchrun-") as tmp:  # torchrun's own torchelastic_* directories
        r = subprocess.run(list(map(str, cmd)), cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": tmp})
    assert r.returncode == 0, r.stderr[-20000:]
    return r.stdout, r.stderr


@pytest.mark.parametrize("task", ["perplexity", "lambada", "hellaswag"])
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
