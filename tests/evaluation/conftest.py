"""Fixtures of the eval tests: realistic-scale weights (tests/realistic.py) and real English text that ships with the
operating system or the Python interpreter (a license, scripts/eval_data.py), never text written for the tests."""

from __future__ import annotations

import pytest
import torch

from scripts import eval_data
from scripts.hf_fixtures import TINY, write_repo
from tests.realistic import realistic_checkpoint, realistic_hf_model

CONTEXT = TINY["n_positions"]  # 64: windows of a tiny model are short, so a few KB of text make many of them


def english() -> str:
    text = eval_data.english()
    if text is None:
        pytest.skip("no license text on this machine")
    return text


@pytest.fixture(scope="session")
def realistic(tmp_path_factory):
    """(hf directory, gpt2port checkpoint) of one realistic-scale tiny model."""
    return realistic_checkpoint(tmp_path_factory.mktemp("eval-model"), TINY, seed=0)


@pytest.fixture(scope="session")
def tuned_hf(tmp_path_factory):
    """The same model moved a little, as a fine-tune or a quantization moves it: an HF directory."""
    model = realistic_hf_model(TINY, seed=0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.05)
    out = tmp_path_factory.mktemp("eval-tuned") / "hf"
    write_repo(model, out, "hub", "fp32")
    return out


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval-text") / "license.txt"
    path.write_text(english()[:6000], encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def lambada_file(tmp_path_factory):
    return eval_data.write_lambada(tmp_path_factory.mktemp("eval-lambada") / "lambada.jsonl",
                                   eval_data.sentences(english())[:60])


@pytest.fixture(scope="session")
def hellaswag_file(tmp_path_factory):
    return eval_data.write_hellaswag(tmp_path_factory.mktemp("eval-hellaswag") / "hellaswag.jsonl", english(), 40)


def run_harness(hf_dir, task: str, data, tmp) -> dict:
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    return eval_data.run_harness(hf_dir, task, data, tmp)
