"""Bad input to `gpt2port eval`: one line naming the file, line, field or option at fault, a non-zero exit, and no
model loaded for a data file that is wrong. And what it prints: the table, --json, --model-card."""

from __future__ import annotations

import json
import re

import pytest

from tests.evaluation.conftest import CONTEXT
from tests.support import assert_clean_failure, run_cli


@pytest.fixture
def write(tmp_path):
    def make(name: str, text: str):
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path
    return make


def _eval(ckpt, task, data, *more):
    return run_cli("eval", ckpt, "--task", task, "--data", data, *more)


def test_a_malformed_jsonl_line_is_named_by_its_number(realistic, lambada_file, write):
    lines = lambada_file.read_text().splitlines()[:5]
    bad = write("bad.jsonl", "\n".join(lines[:3] + ['{"text": "an unfinished', *lines[3:]]) + "\n")
    line = assert_clean_failure(_eval(realistic[1], "lambada", bad), names=[bad, "line 4"])
    assert "not JSON" in line


@pytest.mark.parametrize("row, words", [
    ({"txt": "a b"}, ["line 2", "'text' missing"]),
    ({"text": 3}, ["line 2", "'text' not a string"]),
    ({"text": "single"}, ["line 2", "no last word"]),
    ([1, 2], ["line 2", "not a JSON object"]),
])
def test_lambada_rows_that_are_wrong(realistic, write, row, words):
    bad = write("bad.jsonl", json.dumps({"text": "a real first line"}) + "\n" + json.dumps(row) + "\n")
    assert_clean_failure(_eval(realistic[1], "lambada", bad), names=[bad, *words])


def test_a_label_out_of_range(realistic, hellaswag_file, write):
    rows = [json.loads(s) for s in hellaswag_file.read_text().splitlines()[:3]]
    rows[2]["label"] = 4
    bad = write("bad.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    line = assert_clean_failure(_eval(realistic[1], "hellaswag", bad), names=[bad, "line 3", "label 4"])
    assert "out of range" in line
    rows[2]["label"] = "two"
    bad = write("bad2.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    assert_clean_failure(_eval(realistic[1], "hellaswag", bad), names=[bad, "line 3", "'label' not an integer"])


@pytest.mark.parametrize("task", ["perplexity", "lambada", "hellaswag"])
def test_an_empty_file(realistic, write, task):
    empty = write("empty.txt", "  \n\n")
    assert_clean_failure(_eval(realistic[1], task, empty), names=[empty, "empty"])


def test_a_text_shorter_than_two_tokens(realistic, write):
    short = write("short.txt", "Hello")
    assert_clean_failure(_eval(realistic[1], "perplexity", short), names=[short, "1 token", "at least two"])


@pytest.mark.parametrize("stride", [0, -3, CONTEXT + 1])
def test_a_stride_outside_the_context(realistic, text_file, stride):
    assert_clean_failure(_eval(realistic[1], "perplexity", text_file, "--stride", stride),
                         names=[f"--stride {stride}", f"({CONTEXT})"])


def test_a_published_name_offline_says_to_pass_a_file(realistic):
    line = assert_clean_failure(_eval(realistic[1], "hellaswag", "hellaswag"), names=["--data hellaswag"])
    assert "--data FILE" in line
    assert_clean_failure(_eval(realistic[1], "lambada", "wikitext-2"), names=["--data wikitext-2", "perplexity"])
    assert_clean_failure(_eval(realistic[1], "lambada", "no-such.jsonl"), names=["no-such.jsonl", "no such file"])


def test_options_of_another_task(realistic, lambada_file, text_file):
    assert_clean_failure(_eval(realistic[1], "lambada", lambada_file, "--against", realistic[1]), names=["--against"])
    assert_clean_failure(_eval(realistic[1], "lambada", lambada_file, "--stride", "8"), names=["--stride"])
    assert_clean_failure(_eval(realistic[1], "perplexity", text_file, "--protocol", "nanogpt"), names=["--protocol"])


def test_the_table_the_json_and_the_model_card(realistic, text_file):
    table = _eval(realistic[1], "perplexity", text_file, "-q")
    assert table.exit_code == 0 and table.stderr == ""
    assert "perplexity" in table.stdout and "bits_per_byte" in table.stdout and len(table.stdout.splitlines()) < 12
    data = json.loads(_eval(realistic[1], "perplexity", text_file, "--json").stdout)
    assert {"tokens", "nll", "perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte"} <= set(data)
    card = _eval(realistic[1], "perplexity", text_file, "--model-card").stdout
    assert card.startswith("model-index:") and f"value: {round(data['perplexity'], 4)}" in card
    yaml = pytest.importorskip("yaml")
    parsed = yaml.safe_load(card)["model-index"][0]["results"][0]
    assert parsed["metrics"][0] == {"type": "perplexity", "value": round(data["perplexity"], 4),
                                    "name": f"perplexity (stride {CONTEXT // 2})"}


def test_progress_goes_to_stderr_in_step_lines(realistic, text_file):
    result = _eval(realistic[1], "perplexity", text_file, "--json")
    assert json.loads(result.stdout)["tokens"] > 0  # stdout is the JSON alone
    assert "eval [" in result.stderr and "window 0/" in result.stderr
    # the last count with a rate and what is left, not "window 0/N" until the table
    n = json.loads(result.stdout)["windows"] if "windows" in result.stdout else None
    last = [line for line in result.stderr.splitlines() if "window" in line][-1]
    assert re.search(r"window (\d+)/\1, [\d.e+]+ windows/s, 0 s left$", last), result.stderr
    assert n is None or f"/{n}," in last


def test_threads_are_an_option_and_restored(realistic, text_file):
    import torch

    before = torch.get_num_threads()
    one = _eval(realistic[1], "perplexity", text_file, "--json", "-q", "--threads", "1")
    assert one.exit_code == 0, one.output
    assert torch.get_num_threads() == before
    default = json.loads(_eval(realistic[1], "perplexity", text_file, "--json", "-q").stdout)
    assert json.loads(one.stdout)["perplexity"] == pytest.approx(default["perplexity"], rel=1e-6)
    assert_clean_failure(_eval(realistic[1], "perplexity", text_file, "--threads", "100000"), names=["--threads"])


def test_against_a_model_of_another_shape(realistic, text_file, tmp_path):
    from scripts.hf_fixtures import TINY
    from tests.realistic import realistic_checkpoint

    _, other = realistic_checkpoint(tmp_path / "short", {**TINY, "n_positions": 32})
    assert_clean_failure(_eval(realistic[1], "perplexity", text_file, "--against", other),
                         names=["--against", "n_positions (32)", "(64)"])
