"""The fingerprint that finds a compiled step without exporting the forward (gpt2port/fast/fingerprint.py): the same
in another process for the same code and shapes; another for any change to what the forward may run (a function
swapped in, an edit to a function it reaches, an edit to a source file, a shape, a dtype); none where something it
reads has no description that holds across processes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import torch

from gpt2port import GPT, GPTConfig
from gpt2port.fast import Settings, fingerprint
from gpt2port.fast.cache import new_cache
from tests.support import ROOT

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
MACHINE = ("torch", "cpu", "2 threads")

PRINT = """
import torch
from gpt2port import GPT, GPTConfig
from gpt2port.fast import Settings, fingerprint
from gpt2port.fast.cache import new_cache
model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=16)).eval()
cache = new_cache(model.config, 1, 16, torch.float32, "cpu", None, Settings())[0]
print(fingerprint.of(model, cache, ("torch", "cpu", "2 threads")))
"""


def key(model: GPT, dtype: torch.dtype = torch.float32, length: int = 16) -> str | None:
    cache = new_cache(model.config, 1, length, dtype, "cpu", None, Settings())[0]
    return fingerprint.of(model, cache, MACHINE)


def test_the_same_model_has_the_same_fingerprint_in_another_process():
    here = key(GPT(CONFIG).eval())
    there = [subprocess.run([sys.executable, "-c", PRINT], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            check=True).stdout.strip() for _ in range(2)]
    assert here is not None and there == [here, here]


def test_whatever_the_forward_may_run_differently_is_another_fingerprint():
    base = key(GPT(CONFIG).eval())
    assert key(GPT(CONFIG).eval()) == base  # weights' values are not part of it: they are handed over
    swapped = GPT(CONFIG).eval()
    swapped.blocks[1].mlp.act = lambda x: torch.tanh(x)
    other = GPT(CONFIG).eval()
    other.blocks[1].mlp.act = lambda x: torch.tanh(x) * 2
    wider = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16)).eval()
    keys = [base, key(swapped), key(other), key(wider), key(GPT(CONFIG).eval(), torch.bfloat16),
            key(GPT(CONFIG).eval(), length=8), fingerprint.of(GPT(CONFIG).eval(), new_cache(
                CONFIG, 1, 16, torch.float32, "cpu", None, Settings())[0], ("torch", "cpu", "1 thread"))]
    assert None not in keys and len(set(keys)) == len(keys), keys


def test_an_edit_to_a_function_reached_or_to_its_source_file_is_another_fingerprint(tmp_path):
    """A function's code, the functions it reaches through its globals, and the file it is defined in."""
    source = tmp_path / "acts.py"
    source.write_text("import torch\n\ndef inner(x):\n    return torch.tanh(x)\n\ndef act(x):\n    return inner(x)\n")
    spec = importlib.util.spec_from_file_location("acts_for_fingerprint", source)
    acts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(acts)
    model = GPT(CONFIG).eval()
    model.blocks[0].mlp.act = acts.act
    first = key(model)
    exec("def inner(x):\n    return torch.sigmoid(x)", acts.__dict__)  # what act reaches, redefined
    second = key(model)
    source.write_text(source.read_text() + "# an edit\n")  # the code as loaded unchanged, its file edited
    third = key(model)
    assert None not in (first, second, third) and len({first, second, third}) == 3


def test_an_attribute_with_no_stable_description_gives_no_fingerprint():
    model = GPT(CONFIG).eval()
    model.blocks[0].attn.extra = object()
    assert key(model) is None
    assert key(GPT(CONFIG).eval()) is not None
