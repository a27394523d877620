"""A realistic-scale tiny GPT-2 (tests/realistic.py), its gpt2port checkpoint and its `export --to hf`: the ground
on which gpt2port's LoRA is compared with peft's (adapters with trained-like, non-zero A and B: helpers.py)."""

from __future__ import annotations

import pytest

from scripts.hf_fixtures import TINY
from tests.training.test_finetune import corpus  # noqa: F401 - the fine-tuning tests' text, a fixture


@pytest.fixture(scope="session")
def realistic_base(tmp_path_factory):
    """(gpt2port checkpoint, its --to hf export) of realistic-scale weights."""
    from gpt2port import export
    from tests.realistic import realistic_checkpoint

    root = tmp_path_factory.mktemp("lora-base")
    _, ckpt = realistic_checkpoint(root, {**TINY, "n_layer": 3}, seed=7)
    export(ckpt, root / "hf-export", to="hf")
    return ckpt, root / "hf-export"


@pytest.fixture(scope="session")
def lora_run(realistic_base, corpus, tmp_path_factory):  # noqa: F811 - corpus: the fixture imported above
    """The plain LoRA run (test_lora_cli.py's settings) that test_lora_cli, test_recompute and test_lora_held compare
    with: made once (a fixture of each module, it was made three times)."""
    from tests.lora.test_lora_cli import args
    from tests.support import run_cli

    out = tmp_path_factory.mktemp("lora-run") / "run"
    r = run_cli("finetune", *args(realistic_base[0], corpus, out))
    assert r.exit_code == 0, r.output
    return out
