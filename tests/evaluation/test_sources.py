"""`gpt2port eval` on what gpt2port reads besides its own checkpoints (llm.c's file, a GGUF in f16 or q8_0), and at
int8: each judged against the fp32 checkpoint it came from with --against."""

from __future__ import annotations

import json

import pytest

import gpt2port
from gpt2port.evaluation.run import run_eval
from tests.support import run_cli


@pytest.fixture(scope="module")
def exports(realistic, tmp_path_factory):
    _, ckpt = realistic
    out = tmp_path_factory.mktemp("eval-exports")
    gpt2port.export(ckpt, out / "llmc", to="llmc")
    gpt2port.export(ckpt, out / "gguf", to="gguf", dtype="fp16")
    gpt2port.export(ckpt, out / "q8_0", to="gguf", dtype="q8_0")
    return {"llmc": next((out / "llmc").glob("gpt2_*.bin")), "f16": out / "gguf" / "model.gguf",
            "q8_0": out / "q8_0" / "model.gguf"}


def test_llmc_fp32_is_the_same_model(realistic, exports, text_file):
    ours = run_eval(str(exports["llmc"]), "perplexity", str(text_file), against=str(realistic[1]))
    assert ours["kld"] == pytest.approx(0, abs=1e-7) and ours["top1_agreement"] == 1.0


@pytest.mark.parametrize("how", ["f16", "q8_0", "int8"])
def test_rounded_models_move_a_little(realistic, exports, text_file, how):
    _, ckpt = realistic
    model, dtype = (str(ckpt), "int8") if how == "int8" else (str(exports[how]), None)
    ours = run_eval(model, "perplexity", str(text_file), against=str(ckpt), dtype=dtype)
    assert 1e-7 < ours["kld"] < 0.05, ours  # moved, and not far
    assert ours["top1_agreement"] > 0.9
    assert abs(ours["perplexity_difference"]) < 0.05 * ours["base_perplexity"]


def test_a_q8_0_gguf_is_scored_as_dequantized(realistic, exports, text_file):
    result = run_cli("eval", exports["q8_0"], "--task", "perplexity", "--data", text_file, "--against", realistic[1],
                     "--json")
    assert result.exit_code == 0, result.output
    assert f"{exports['q8_0']}: its q8_0 weights dequantized to fp32 for this run" in result.stderr
    scored = json.loads(result.stdout)
    assert 1e-7 < scored["kld"] < 0.05 and scored["perplexity"] != scored["base_perplexity"]
