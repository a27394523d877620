"""`gpt2port eval --task perplexity`: the Hugging Face guide's sliding window, against the guide's loop over
transformers; --against, against a KL loop over transformers."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from gpt2port.evaluation.run import run_eval
from gpt2port.evaluation.windows import plan
from tests.evaluation.conftest import CONTEXT
from tests.support import run_cli


def _hf(directory):
    from transformers import GPT2LMHeadModel, GPT2TokenizerFast

    return GPT2LMHeadModel.from_pretrained(directory).eval(), GPT2TokenizerFast.from_pretrained(directory)


@torch.no_grad()
def guide_loop(model, ids: torch.Tensor, stride: int) -> tuple[float, int]:
    """The guide's loop as it stands, summing each window's mean loss times the count it averaged over (the
    labels left after the model's internal shift), which is the guide's intent (its N.B.)."""
    max_length, seq_len = model.config.n_positions, ids.size(1)
    nll_sum, n_tokens, prev_end_loc = 0.0, 0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end_loc
        input_ids = ids[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        loss = model(input_ids, labels=target_ids).loss
        counted = int((target_ids[:, 1:] != -100).sum())
        nll_sum += loss.item() * counted
        n_tokens += counted
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return nll_sum, n_tokens


@pytest.mark.parametrize("stride", [CONTEXT // 2, 3 * CONTEXT // 8])
def test_perplexity_equals_the_hf_guides_loop(realistic, text_file, stride):
    hf_dir, ckpt = realistic
    model, tok = _hf(hf_dir)
    text = text_file.read_text()
    ids = tok(text, return_tensors="pt").input_ids
    nll_sum, n_tokens = guide_loop(model, ids, stride)
    ours = run_eval(str(ckpt), "perplexity", str(text_file), stride=stride, batch_tokens=3 * CONTEXT)
    assert ours["tokens"] == n_tokens == ids.size(1) - 1
    assert ours["perplexity"] == pytest.approx(math.exp(nll_sum / n_tokens), rel=1e-6)
    assert ours["perplexity"] > 100  # weights at trained scales, untrained: far from a uniform 50257 or from 1
    # lm-evaluation-harness's wikitext normalizations: words split on whitespace runs, UTF-8 bytes
    words, n_bytes = len(re.split(r"\s+", text)), len(text.encode("utf-8"))
    assert ours["word_perplexity"] == pytest.approx(math.exp(nll_sum / words), rel=1e-6)
    assert ours["byte_perplexity"] == pytest.approx(math.exp(nll_sum / n_bytes), rel=1e-6)
    assert ours["bits_per_byte"] == pytest.approx(nll_sum / n_bytes / math.log(2), rel=1e-6)


@pytest.mark.parametrize("stride", [1, 5, 31, 32, 63, 64])
def test_every_token_after_the_first_is_predicted_once(stride):
    for n in (2, 3, 64, 65, 200, 257):
        seen = []
        for a, first, end in plan(n, CONTEXT, stride):
            assert end - 1 - a <= CONTEXT and a < first  # the window fits, and each target has a token before it
            seen += range(first, end)
            assert first - a >= min(first, CONTEXT - stride)  # at least context - stride tokens before each
        assert seen == list(range(1, n))


@torch.no_grad()
def kl_loop(base, model, ids: torch.Tensor, stride: int) -> dict:
    """Both HF models over the guide's windows: KL(base || model) and top-1 agreement per newly predicted token."""
    kl, agree, count, prev_end = 0.0, 0, 0, 0
    for begin in range(0, ids.size(1), stride):
        end = min(begin + base.config.n_positions, ids.size(1))
        window = ids[:, begin:end]
        new = end - max(prev_end, begin + 1)  # the positions predicting tokens no window predicted before
        lb = torch.log_softmax(base(window).logits[0, -new - 1 : -1], -1)
        lm = torch.log_softmax(model(window).logits[0, -new - 1 : -1], -1)
        kl += (lb.exp() * (lb - lm)).sum().item()
        agree += int((lb.argmax(-1) == lm.argmax(-1)).sum())
        count += new
        prev_end = end
        if end == ids.size(1):
            break
    return {"kld": kl / count, "top1_agreement": agree / count, "tokens": count}


def test_against_equals_a_kl_loop_over_transformers(realistic, tuned_hf, text_file):
    hf_dir, ckpt = realistic
    base, tok = _hf(hf_dir)
    tuned, _ = _hf(tuned_hf)
    ids = tok(text_file.read_text(), return_tensors="pt").input_ids
    expected = kl_loop(base, tuned, ids, CONTEXT // 2)
    # the tuned model from its Hugging Face directory (converted for the run), the base from its checkpoint
    result = run_cli("eval", tuned_hf, "--task", "perplexity", "--data", text_file, "--against", ckpt, "--json")
    assert result.exit_code == 0, result.output
    ours = json.loads(result.stdout)
    assert ours["tokens"] == expected["tokens"]
    assert ours["kld"] == pytest.approx(expected["kld"], rel=1e-5)
    assert 0.01 < ours["kld"] < 5  # a real difference, not a model against itself
    assert ours["top1_agreement"] == pytest.approx(expected["top1_agreement"], abs=0.5 / expected["tokens"])
    alone = run_eval(str(ckpt), "perplexity", str(text_file))
    assert ours["base_perplexity"] == pytest.approx(alone["perplexity"], rel=1e-6)
    assert ours["perplexity_difference"] == pytest.approx(ours["perplexity"] - alone["perplexity"], rel=1e-9)


def test_a_model_against_itself_is_zero(realistic, text_file):
    _, ckpt = realistic
    ours = run_eval(str(ckpt), "perplexity", str(text_file), against=str(ckpt))
    assert ours["kld"] == pytest.approx(0, abs=1e-7) and ours["top1_agreement"] == 1.0
