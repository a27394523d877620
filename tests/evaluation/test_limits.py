"""eval's inputs sized and checked before any figure: hostile jsonl, NaN models and bases (naming which), a
--batch-tokens no machine holds, PyTorch's own allocation failure, a killed run's temporary directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from tests.support import assert_clean_failure, run_cli


def _eval(ckpt, task, data, *more):
    return run_cli("eval", ckpt, "--task", task, "--data", data, *more)


@pytest.fixture(scope="module")
def nan_ckpt(realistic, tmp_path_factory):
    """The realistic checkpoint with one NaN planted in a block's MLP weight (a copy; the fixture stays clean)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("eval-nan") / "ckpt"
    shutil.copytree(realistic[1], out)
    sd = load_file(out / "model.safetensors")
    key = next(k for k in sd if "mlp" in k and k.endswith("weight"))
    sd[key][0, 0] = float("nan")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        meta = f.metadata()
    save_file(sd, out / "model.safetensors", metadata=meta)  # the same size: the manifest's record still holds
    return out, key


def test_a_model_with_nan_weights_is_refused_naming_it(nan_ckpt, text_file):
    ckpt, key = nan_ckpt
    r = _eval(ckpt, "perplexity", text_file)
    assert_clean_failure(r, [ckpt, "NaN or Inf", "the model's"])
    assert r.stdout == ""  # no figure printed


def test_an_against_base_with_nan_weights_is_named_as_the_base(realistic, nan_ckpt, text_file):
    ckpt, _ = nan_ckpt
    assert_clean_failure(_eval(realistic[1], "perplexity", text_file, "--against", ckpt),
                         [ckpt, "NaN or Inf", "--against base"])


def test_batch_tokens_beyond_the_machine_is_refused_naming_the_option(realistic, text_file):
    line = assert_clean_failure(_eval(realistic[1], "perplexity", text_file, "--batch-tokens", 10 ** 12),
                                ["--batch-tokens 1000000000000", "GB"])
    assert "at most" in line


def test_pytorch_s_allocation_failure_is_the_out_of_memory_line(realistic, text_file, monkeypatch):
    """A real DefaultCPUAllocator failure (a RuntimeError, not a MemoryError), raised where a batch is scored."""
    from gpt2port.evaluation import windows

    def huge(*args, **kwargs):
        return torch.empty(1 << 50, dtype=torch.uint8)  # 1 PB: refused by the allocator itself
    monkeypatch.setattr(windows, "_score", huge)
    line = assert_clean_failure(_eval(realistic[1], "perplexity", text_file),
                                ["gpt2port eval", "out of memory", "--batch-tokens"])
    assert "internal error" not in line


@pytest.mark.parametrize("row, words", [
    ({"ctx_a": "A man", "ctx_b": "is", "activity_label": "Cooking", "endings": ["x", "[title]", "y", "z"],
      "label": 0}, ["line 2", "ending 1 is empty after the harness's preprocessing"]),
    ({"ctx_a": "A man", "ctx_b": "is", "activity_label": "Cooking", "endings": ["x", "y"], "label": "9" * 5000},
     ["line 2", "'label' not an integer"]),
    ({"ctx_a": "A man", "ctx_b": "is", "activity_label": "Cooking", "endings": ["x", "y"], "label": "²"},
     ["line 2", "'label' not an integer"]),
])
def test_hellaswag_rows_of_the_wrong_kind(realistic, hellaswag_file, tmp_path, row, words):
    first = hellaswag_file.read_text().splitlines()[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(first + "\n" + json.dumps(row) + "\n")
    assert_clean_failure(_eval(realistic[1], "hellaswag", bad), [bad, *words])


@pytest.mark.parametrize("text, words", [
    ("[" * 50_000, ["line 2", "nested"]),
    ('{"text": 1' + "0" * 5000 + "}", ["line 2"]),
    (json.dumps({"text": "a last word "}), ["line 2", "ends in a space"]),
])
def test_lambada_lines_of_the_wrong_kind(realistic, tmp_path, text, words):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "a real first line"}) + "\n" + text + "\n")
    line = assert_clean_failure(_eval(realistic[1], "lambada", bad), [bad, *words])
    assert "internal error" not in line


def test_a_killed_run_s_temporary_directory_is_swept_by_the_next(realistic, text_file):
    """eval converts an HF directory into $TMPDIR/gpt2port-eval-PID-*; SIGKILL leaves it; the next eval removes it
    (and leaves a look-alike without the mark, and a live process's)."""
    from gpt2port.fsio import TEMP_MARK

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    tmp = tempfile.gettempdir()
    left = os.path.join(tmp, f"gpt2port-eval-{pid}-abc")
    look_alike = os.path.join(tmp, f"gpt2port-eval-{pid}-user")
    live = os.path.join(tmp, f"gpt2port-eval-{os.getpid()}-live")
    for d in (left, look_alike, live):
        os.makedirs(os.path.join(d, "model"), exist_ok=True)
    for d in (left, live):
        with open(os.path.join(d, TEMP_MARK), "w") as f:
            f.write(os.path.basename(d))
    try:
        r = _eval(realistic[0], "perplexity", text_file)  # the HF directory: converted in a temporary directory
        assert r.exit_code == 0, r.stderr
        assert not os.path.exists(left)
        assert os.path.isdir(look_alike) and os.path.isdir(live)
        assert not [n for n in os.listdir(tmp) if n.startswith(f"gpt2port-eval-{os.getpid()}-") and
                    os.path.join(tmp, n) != live]  # its own removed after loading
    finally:
        for d in (left, look_alike, live):
            shutil.rmtree(d, ignore_errors=True)
