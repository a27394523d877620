"""`gpt2port generate`'s options that users of transformers look for: stop strings and the repetition penalty equal
to transformers' own on the same weights, a file of prompts batched into JSON lines, a prompt from stdin without its
trailing newline."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch

from gpt2port import load_tokenizer
from gpt2port.generate import generate, penalize
from gpt2port.generate_options import read_prompt
from tests import test_generate
from tests.test_generate import hf_greedy, run_cli

lively = test_generate.lively  # its fixture: a tiny model that says something other than one token

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["The dog ran", "Once upon a time there was", "<|endoftext|>", "1, 2, 3,"]


def test_the_repetition_penalty_is_transformers_processor_on_every_logit():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 500, generator=g) * 4  # positive and negative logits, seen and unseen tokens
    ids = torch.randint(0, 500, (3, 40), generator=g)
    seen = torch.zeros(3, 500, dtype=torch.bool)
    seen[torch.arange(3)[:, None], ids] = True
    for penalty in (1.3, 0.7):
        expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
        assert torch.equal(penalize(logits, seen, penalty), expected)


@pytest.mark.parametrize("penalty", [1.5, 0.8])
def test_greedy_with_a_repetition_penalty_equals_transformers_token_for_token(lively, penalty):
    hf, model, ckpt = lively
    tok = load_tokenizer(ckpt)
    for prompt in PROMPTS:
        ids = tok.encode(prompt, allowed_special="all")
        with torch.inference_mode():
            theirs = hf.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False, repetition_penalty=penalty,
                                 pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
        assert generate(model, [ids], 30, temperature=0, repetition_penalty=penalty, stop_token=None)[0] == theirs
    # the penalty changes what a lively model says (else the test above would prove nothing)
    ids = tok.encode(PROMPTS[0])
    assert generate(model, [ids], 30, temperature=0, repetition_penalty=penalty) != hf_greedy(hf, [ids], 30)[0]


def _hf_until(hf, ckpt_root, ids, stop, n):
    """transformers' generate with stop_strings: its new tokens."""
    from transformers import GPT2TokenizerFast

    hf_tok = GPT2TokenizerFast.from_pretrained(ckpt_root.parent / "hf")
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None,
                          stop_strings=[stop], tokenizer=hf_tok)
    return out[0, len(ids):].tolist()


def test_stop_strings_end_where_transformers_stop_strings_do(lively, capsys):
    hf, model, ckpt = lively
    tok = load_tokenizer(ckpt)
    prompt = "The dog ran"
    ids = tok.encode(prompt)
    free = generate(model, [ids], 40, temperature=0)[0]
    pieces = [tok.decode([t]) for t in free]
    # a stop string across two tokens' text: the end of the 12th and the start of the 13th
    stop = pieces[11][-2:] + pieces[12][:2]
    theirs = _hf_until(hf, ckpt, ids, stop, 40)
    assert len(theirs) < 40  # transformers stopped early, on that string
    text = tok.decode(theirs)
    code, out = run_cli(capsys, ckpt, prompt, "-n", 40, "--temperature", 0, "--device", "cpu", "--stop", stop,
                        "--stop", "never appears")
    assert code == 0, out.err
    assert out.out == prompt + text[:text.index(stop)] + "\n"
    # one prefill token, then a decode step for each of transformers' other tokens: stopped at the same token
    assert re.search(rf"then {len(theirs) - 1} tokens in ", out.err), out.err


def test_a_file_of_prompts_gives_one_json_line_each_as_alone(lively, capsys, tmp_path):
    _, model, ckpt = lively
    tok = load_tokenizer(ckpt)
    lines = tmp_path / "prompts.txt"
    lines.write_text("\n".join(PROMPTS) + "\n\n")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(PROMPTS)))
    alone = [generate(model, [tok.encode(p, allowed_special="all")], 12, temperature=0)[0] for p in PROMPTS]
    for path in (lines, jsonl):
        code, out = run_cli(capsys, ckpt, "--prompts", path, "-n", 12, "--temperature", 0, "--device", "cpu")
        assert code == 0, out.err
        rows = [json.loads(line) for line in out.out.splitlines()]
        assert [r["prompt"] for r in rows] == PROMPTS
        assert [r["text"] for r in rows] == [tok.decode(a) for a in alone]
        assert [r["tokens"] for r in rows] == [len(a) for a in alone]
        assert re.search(r"^4 prompts, \d+ new tokens in ", out.err, re.M), out.err
    # a stop string ends each row before it
    stop = tok.decode(alone[1])[3:6]
    code, out = run_cli(capsys, ckpt, "--prompts", lines, "-n", 12, "--temperature", 0, "--device", "cpu",
                        "--stop", stop)
    texts = [json.loads(line)["text"] for line in out.out.splitlines()]
    assert texts[1] == tok.decode(alone[1])[:3] and all(stop not in t for t in texts)


def test_prompt_files_and_prompt_arguments_refused_in_one_line(lively, capsys, tmp_path):
    _, _, ckpt = lively
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n\n{"text": "no prompt"}\n')
    code, out = run_cli(capsys, ckpt, "--prompts", bad)
    assert code == 1 and out.err.count("\n") == 1 and "bad.jsonl, line 3" in out.err and "prompt" in out.err
    code, out = run_cli(capsys, ckpt, "--prompts", tmp_path / "absent.txt")
    assert code == 1 and out.err.count("\n") == 1 and "absent.txt" in out.err
    (tmp_path / "blank.txt").write_text("\n  \n")
    code, out = run_cli(capsys, ckpt, "--prompts", tmp_path / "blank.txt")
    assert code == 1 and "holds no prompt" in out.err
    code, out = run_cli(capsys, ckpt, "hi", "--prompts", bad)
    assert code == 2 and "not both" in out.err
    code, out = run_cli(capsys, ckpt)
    assert code == 2 and "PROMPT" in out.err
    code, out = run_cli(capsys, ckpt, "hi", "--repetition-penalty", "nan")
    assert code == 1 and "--repetition-penalty" in out.err


def test_a_prompt_from_stdin_loses_its_trailing_newline(lively, capsys, monkeypatch):
    assert read_prompt("-", io.StringIO("A prompt\n")) == "A prompt"
    assert read_prompt("-", io.StringIO("A prompt\r\n")) == "A prompt"
    assert read_prompt("-", io.StringIO("two lines\n\n")) == "two lines\n"  # only one newline is the shell's
    assert read_prompt("kept\n") == "kept\n"  # an argument is taken as typed
    _, _, ckpt = lively
    monkeypatch.setattr("sys.stdin", io.StringIO("The dog\n"))
    code, out = run_cli(capsys, ckpt, "-", "-n", 3, "--temperature", 0, "--device", "cpu")
    assert code == 0 and out.out.startswith("The dog") and not out.out.startswith("The dog\n")
    assert re.search(r"^prefill 2 tokens in", out.err, re.M), out.err
