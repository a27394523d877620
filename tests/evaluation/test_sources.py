"""`gpt2port eval` on what gpt2port reads besides its own checkpoints (llm.c's file, a GGUF in f16), and at int8:
each judged against the fp32 checkpoint it came from with --against. A q8_0 GGUF gpt2port does not read: refused in
one line."""

from __future__ import annotations

import pytest

import gpt2port
from gpt2port.evaluation.run import run_eval
from tests.support import assert_clean_failure, run_cli


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


@pytest.mark.parametrize("how", ["f16", "int8"])
def test_rounded_models_move_a_little(realistic, exports, text_file, how):
    _, ckpt = realistic
    model, dtype = (str(exports["f16"]), None) if how == "f16" else (str(ckpt), "int8")
    ours = run_eval(model, "perplexity", str(text_file), against=str(ckpt), dtype=dtype)
    assert 1e-7 < ours["kld"] < 0.05, ours  # moved, and not far
    assert ours["top1_agreement"] > 0.9
    assert abs(ours["perplexity_difference"]) < 0.05 * ours["base_perplexity"]


def test_a_q8_0_gguf_is_refused_in_one_line(realistic, exports, text_file):
    result = run_cli("eval", exports["q8_0"], "--task", "perplexity", "--data", text_file)
    assert_clean_failure(result, names=[exports["q8_0"], "Q8_0"])
