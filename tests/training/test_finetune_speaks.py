"""What a fine-tuning run says while it runs and when it ends: evaluations scaled to the run (a 6-step run is not 7
evaluations), a line in a log for every step of a short run, samples of its text with --sample-every (nanoGPT's),
and a closing line naming every output, the LoRA adapter included."""

from __future__ import annotations

import re

import pytest

from gpt2port.training.finetune import default_eval_every
from tests.support import run_cli
from tests.training.test_finetune import corpus, rows  # noqa: F401 - corpus: its session fixture


@pytest.mark.parametrize("steps, batch, windows, every", [
    (6, 8, 32, 6),  # evaluated before the first step and after the last, nothing between
    (50, 8, 32, 16),  # three between: within a tenth of the training's work
    (1000, 8, 32, 100),  # a long run: ten, every steps // 10, as before
    (3, 1, 1000, 3),
])
def test_evaluations_scale_with_the_run(steps, batch, windows, every):
    assert default_eval_every(steps, batch, windows) == every


def test_a_short_lora_run_speaks_each_step_samples_and_names_its_adapter(tiny_ckpt, corpus, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    r = run_cli("finetune", tiny_ckpt, "--data", corpus, "--out", out, "--steps", "6", "--batch-size", "8",
                "--block-size", "32", "--lora", "4", "--sample-every", "3")
    assert r.exit_code == 0, r.output
    assert [row["step"] for row in rows(out) if "eval_loss" in row] == [0, 6]
    err = r.stderr.splitlines()
    assert [int(m.group(1)) for line in err if (m := re.match(r"step (\d)/6: loss ", line))] == [1, 2, 3, 4, 5, 6]
    samples = [line for line in err if re.match(r"step [36]/6 sample: '.+'$", line)]
    assert len(samples) == 2, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith(f"wrote {out}: ") and "train_log.jsonl" in last and "loss.svg" in last
    assert f"adapter/ (the LoRA adapter in peft's format: gpt2port merge BASE {out / 'adapter'})" in last
    assert (out / "adapter" / "adapter_config.json").is_file()
