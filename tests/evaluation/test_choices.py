"""`gpt2port eval --task lambada|hellaswag` against lm-evaluation-harness itself (its own lambada_openai and
hellaswag task files, over the same local jsonl and the same model exported to Hugging Face's layout), and HellaSwag
with --protocol nanogpt against build-nanogpt's scoring loop over transformers."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from gpt2port.evaluation.run import run_eval
from scripts.eval_data import sentences
from tests.evaluation.conftest import english, run_harness


@pytest.fixture(scope="module")
def lambada_mixed(realistic, lambada_file, tmp_path_factory):
    """The license's sentences, and as many again whose last word is the model's own greedy next word (an
    untrained model guesses no real last word, and the accuracy would be 0 on both sides, proving nothing)."""
    from transformers import GPT2LMHeadModel, GPT2TokenizerFast

    hf_dir, _ = realistic
    model, tok = GPT2LMHeadModel.from_pretrained(hf_dir).eval(), GPT2TokenizerFast.from_pretrained(hf_dir)
    rows = lambada_file.read_text().splitlines()
    with torch.no_grad():
        for s in sentences(english())[60:160]:
            prefix = " ".join(s.split()[:-1])
            ids = tok(prefix, return_tensors="pt").input_ids[:, -model.config.n_positions :]
            nxt = tok.decode(int(model(ids).logits[0, -1].argmax()))
            if nxt.startswith(" ") and nxt[1:].isalpha():
                rows.append(json.dumps({"text": prefix + nxt}))
    path = tmp_path_factory.mktemp("eval-lambada-mixed") / "lambada.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_lambada_equals_the_harness(realistic, lambada_mixed, tmp_path):
    hf_dir, ckpt = realistic
    expected = run_harness(hf_dir, "lambada_openai", lambada_mixed, tmp_path)
    ours = run_eval(str(ckpt), "lambada", str(lambada_mixed), batch_tokens=256)
    assert ours["examples"] == len(lambada_mixed.read_text().splitlines())
    assert 0.1 < ours["accuracy"] < 0.9  # greedy and not greedy both met
    assert ours["accuracy"] == expected["acc"]
    assert ours["perplexity"] == pytest.approx(expected["perplexity"], rel=1e-6)


def test_hellaswag_equals_the_harness(realistic, hellaswag_file, tmp_path):
    hf_dir, ckpt = realistic
    expected = run_harness(hf_dir, "hellaswag", hellaswag_file, tmp_path)
    ours = run_eval(str(ckpt), "hellaswag", str(hellaswag_file))
    assert ours["examples"] == len(hellaswag_file.read_text().splitlines()) > 20
    assert ours["acc"] == expected["acc"]
    assert ours["acc_norm"] == expected["acc_norm"]
    assert ours["acc"] != ours["acc_norm"]  # the normalization changed some choices: both paths are exercised


@torch.no_grad()
def nanogpt_loop(model, tok, path) -> dict:
    """build-nanogpt's hellaswag.py: ctx and " " + ending encoded apart, four rows zero-padded, the mean and the sum
    of the ending's cross-entropy; the prediction is the row with the least."""
    acc = acc_norm = n = 0
    for line in path.read_text().splitlines():
        example = json.loads(line)
        ctx_tokens = tok.encode(example["ctx"])
        rows = [ctx_tokens + tok.encode(" " + end) for end in example["endings"]]
        masks = [[0] * len(ctx_tokens) + [1] * (len(r) - len(ctx_tokens)) for r in rows]
        width = max(len(r) for r in rows)
        tokens = torch.zeros(4, width, dtype=torch.long)
        mask = torch.zeros(4, width, dtype=torch.long)
        for i, (r, m) in enumerate(zip(rows, masks)):
            tokens[i, : len(r)], mask[i, : len(m)] = torch.tensor(r), torch.tensor(m)
        logits = model(tokens).logits
        losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none").view(4, -1)
        shift_mask = mask[:, 1:]
        sum_loss = (losses * shift_mask).sum(1)
        avg_loss = sum_loss / shift_mask.sum(1)
        acc += int(sum_loss.argmin()) == example["label"]
        acc_norm += int(avg_loss.argmin()) == example["label"]
        n += 1
    return {"acc": acc / n, "acc_norm": acc_norm / n}


def test_hellaswag_nanogpt_protocol_equals_build_nanogpts_loop(realistic, hellaswag_file):
    from transformers import GPT2LMHeadModel, GPT2TokenizerFast

    hf_dir, ckpt = realistic
    model, tok = GPT2LMHeadModel.from_pretrained(hf_dir).eval(), GPT2TokenizerFast.from_pretrained(hf_dir)
    expected = nanogpt_loop(model, tok, hellaswag_file)
    ours = run_eval(str(ckpt), "hellaswag", str(hellaswag_file), protocol="nanogpt")
    assert ours["protocol"] == "nanogpt"
    assert (ours["acc"], ours["acc_norm"]) == (expected["acc"], expected["acc_norm"])
    harness = run_eval(str(ckpt), "hellaswag", str(hellaswag_file))
    assert (harness["acc"], harness["acc_norm"]) != (ours["acc"], ours["acc_norm"])  # the protocols differ
