"""The decode step (gpt2port/fast/graph.py): the model's forward, called as it is, compiled ahead of time on the CPU
(opt-in: torch.export and AOTInductor, gpt2port/fast/package.py), or recorded as a CUDA graph. Both captures take the
forward's static-shape form (the position a tensor): that form is held to the forward with the position a number, logits
and cache, for a batch with left padding; the compiled step is held to the forward token by token, and one that cannot
be compiled or is not asked for says why; a graph's recording needs a CUDA device (those tests skip without one;
scripts/gpu_check.sh runs them)."""

from __future__ import annotations

import re

import pytest
import torch

from gpt2port import GPT, GPTConfig
from gpt2port.fast import OFF, Settings, decode_step
from gpt2port.fast.cache import new_cache
from gpt2port.generate import _left_pad, generate
from gpt2port.model import KVCache
from tests.realistic import make_realistic_

CONFIG = GPTConfig(n_layer=3, n_head=4, n_embd=32, vocab_size=300, n_positions=48)
PROMPTS = [[5, 17, 250, 3, 99, 12, 7], [42], [8, 8, 9, 100]]  # rows 1 and 2 are left-padded
pytestmark = pytest.mark.usefixtures("one_thread")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def model_on(device: str = "cpu", dtype: torch.dtype = torch.float32) -> GPT:
    return make_realistic_(GPT(CONFIG), seed=0).eval().to(device=device, dtype=dtype)


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one row", "left-padded batch"])
def test_the_static_shape_forward_is_the_forward(prompts):
    """pos a (1,) tensor (what a graph records) against pos a number: the same logits and the same cache."""
    model = model_on()
    tokens, pad = _left_pad(prompts, "cpu")
    caches = [KVCache(CONFIG, len(prompts), tokens.size(1) + 6, pad=pad) for _ in range(2)]
    with torch.inference_mode():
        logits = [model(tokens, cache=c, logits_to_keep=1)[0] for c in caches]
        for pos in range(tokens.size(1), tokens.size(1) + 6):
            nxt = logits[0][:, -1].argmax(-1, keepdim=True)
            logits = [model(nxt, cache=caches[0], pos=pos, logits_to_keep=1)[0],
                      model(nxt, cache=caches[1], pos=torch.tensor([pos]), logits_to_keep=1)[0]]
            torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[1].k, caches[0].k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[1].v, caches[0].v, rtol=1e-5, atol=1e-5)


def test_on_the_cpu_the_step_is_the_forward_as_it_is():
    model = model_on()
    cache = KVCache(CONFIG, 1, 8)
    step = decode_step(model, cache, Settings(cuda_graph=True), "attention on SDPA (switched off)")
    assert step.description == "the model's forward; attention on SDPA (switched off)"
    with torch.inference_mode():
        model(torch.tensor([[1, 2]]), cache=cache)
        torch.testing.assert_close(step(torch.tensor([[3]]), 2),
                                   model(torch.tensor([[1, 2, 3]]))[0][:, -1:], rtol=1e-5, atol=1e-5)


def model_in(dtype: str, tmp_path) -> GPT:
    model = model_on()
    if dtype == "int8":
        model.save_pretrained(tmp_path / "ckpt")
        return GPT.from_pretrained(tmp_path / "ckpt", dtype="int8")
    return model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_on_the_cpu_one_row_generates_what_the_forward_does(dtype, tmp_path, native_kernels):
    """By default one row on gpt2port's kernels is the forward replayed from C++ (fp32, bf16; int8's packed weights
    cannot be held, and it says so); called as it is where replay is switched off: the same tokens each way."""
    model = model_in(dtype, tmp_path)
    want = generate(model, PROMPTS[:1], 30, temperature=0, stop_token=None, fast=OFF)
    for settings in (Settings(), Settings(replay=False)):
        report = []
        got = generate(model, PROMPTS[:1], 30, temperature=0, stop_token=None, fast=settings, report=report)
        assert got == want, (settings, report)
        if not native_kernels.attend_one:
            assert report[-1].startswith("the model's forward; attention on SDPA ("), report
        elif not settings.replay:
            assert report[-1] == "the model's forward; attention on gpt2port's kernel", report
        elif dtype == "int8":
            assert report[-1].startswith("the model's forward (no replay: int8's one-row products take fbgemm's "
                                         "packed weights, which a capture cannot hold)"), report
        else:
            assert re.fullmatch(r"the model's forward, replayed from C\+\+ \(its \d+ operator calls recorded once\); "
                                r"attention on gpt2port's kernel", report[-1]), report


COMPILED = "the model's forward, compiled ahead of time by AOTInductor"


def compiled_generation(model, prompts, n: int, report: list) -> list[list[int]]:
    return generate(model, prompts, n, temperature=0, stop_token=None, fast=Settings(compile=True), report=report)


def test_compiled_the_step_generates_what_the_forward_does(tmp_path, native_kernels):
    """Settings(compile=True): the forward compiled ahead of time on its first step, checked, then run compiled;
    a later generation of another length runs what the first compiled (the cache is the whole context). fp32: the
    same tokens (bf16's are held to the forward logit by logit in test_edits.py: Inductor rounds bf16 its own way,
    and a near tie may then go the other way)."""
    if not native_kernels.attend_one:
        pytest.skip(f"no attention kernel here (a step is compiled where it serves): {native_kernels.binding_why_not}")
    model = model_on()
    for prompt, n in ((PROMPTS[0], 20), (PROMPTS[0][:2], 30)):
        report = []
        got = compiled_generation(model, [prompt], n, report)
        assert report[-1].startswith(COMPILED), report
        assert got == generate(model, [prompt], n, temperature=0, stop_token=None, fast=OFF)


STORED = """
import sys, torch
from gpt2port import GPT, GPTConfig
from gpt2port.fast import OFF, Settings
from gpt2port.generate import generate
from tests.realistic import make_realistic_
torch.set_num_threads(1)
exports, real = [], torch.export.export
torch.export.export = lambda *a, **k: exports.append(1) or real(*a, **k)
model = make_realistic_(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=200, n_positions=24)), seed=1).eval()
report = []
got = generate(model, [[3, 9, 27]], 12, temperature=0, stop_token=None, fast=Settings(compile=True), report=report)
assert got == generate(model, [[3, 9, 27]], 12, temperature=0, stop_token=None, fast=OFF)
print(report[-1])
print("exports:", len(exports))
"""


def test_a_compiled_step_is_stored_once_per_machine_and_loaded_by_a_later_process(native_kernels):
    """The first process compiles the step into the per-machine cache, and says so on stderr; a second process of
    the same model loads that package by the model's fingerprint: no compile, no export, the same tokens as the
    forward."""
    if not native_kernels.attend_one:
        pytest.skip(f"no attention kernel here (a step is compiled where it serves): {native_kernels.binding_why_not}")
    import subprocess
    import sys

    from gpt2port.fast import native
    from gpt2port.fast.package import ANNOUNCE
    from tests.support import ROOT

    steps = native.cache_dir() / "steps"
    before = set(steps.glob("*.pt2")) if steps.is_dir() else set()
    runs = [subprocess.run([sys.executable, "-c", STORED], cwd=ROOT, capture_output=True, text=True, timeout=600)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.strip().startswith(COMPILED), run.stdout
    assert ANNOUNCE in runs[0].stderr and ANNOUNCE not in runs[1].stderr, (runs[0].stderr, runs[1].stderr)
    assert len(set(steps.glob("*.pt2")) - before) == 1
    assert [run.stdout.split("exports:")[1].strip() for run in runs] == ["1", "0"], [run.stdout for run in runs]


def test_a_package_found_by_fingerprint_that_disagrees_is_declined_and_forgotten(native_kernels, monkeypatch):
    """The fingerprint is a shortcut, the check the proof: a model whose fingerprint names another model's package
    (here written by hand: tanh where the package computes GELU) decodes as it is, says why, and the fingerprint is
    forgotten (the next generation exports the forward to name its package)."""
    if not native_kernels.attend_one:
        pytest.skip(f"no attention kernel here (a step is compiled where it serves): {native_kernels.binding_why_not}")
    from gpt2port.fast import fingerprint, native, package

    steps = native.cache_dir() / "steps"
    monkeypatch.setattr(package, "_LOADED", {})  # each model found by its fingerprint, not by this process's memo
    keys, real = [], fingerprint.of

    def of(*args):
        keys.append(real(*args))
        if len(keys) == 2:  # the second model's fingerprint made to name the first's package
            (steps / f"{keys[1]}.key").write_text((steps / f"{keys[0]}.key").read_text())
        return keys[-1]

    monkeypatch.setattr(fingerprint, "of", of)
    compiled_generation(model_on(), PROMPTS[:1], 4, [])  # GELU's package, found or stored
    model = model_on()
    model.blocks[2].mlp.act = lambda x: torch.tanh(x) * 1.0  # a function of its own: no other test's model has it
    report = []
    got = compiled_generation(model, PROMPTS[:1], 12, report)
    assert len(keys) == 2 and None not in keys and keys[0] != keys[1], keys
    assert report[-1].startswith("the model's forward (not compiled: its compiled forward disagreed"), report
    assert got == generate(model, PROMPTS[:1], 12, temperature=0, stop_token=None, fast=OFF)
    assert not (steps / f"{keys[1]}.key").exists() and (steps / f"{keys[0]}.key").exists()


def test_an_int4_step_compiled_generates_what_int4_does(tmp_path, native_kernels):
    """int4's one-row products (gpt2port::matvec_int4) are operators the compiled step calls as the forward does."""
    if not native_kernels.attend_one:
        pytest.skip(f"no attention kernel here (a step is compiled where it serves): {native_kernels.binding_why_not}")
    from gpt2port.fast.int4 import from_pretrained, why_not

    if why_not() is not None:
        pytest.skip(f"no int4 kernel here: {why_not()}")
    model_on().save_pretrained(tmp_path / "ckpt")
    int4 = from_pretrained(tmp_path / "ckpt", "int4")
    report = []
    got = compiled_generation(int4, PROMPTS[:1], 16, report)
    assert report[-1].startswith(COMPILED), report
    assert got == generate(int4, PROMPTS[:1], 16, temperature=0, stop_token=None, fast=Settings())


def test_a_loaded_step_serves_the_next_generation_until_the_model_changes(native_kernels, monkeypatch):
    """Within a process the loaded package is kept for the model as it is (any model of the same code and shapes:
    its tensors are handed over anew each time): a second generation exports nothing; an activation swapped in is
    another model, exported (and compiled) anew, and generates what it computes."""
    if not native_kernels.attend_one:
        pytest.skip(f"no attention kernel here (a step is compiled where it serves): {native_kernels.binding_why_not}")
    exports = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exports.append(1) or real(*a, **k))
    model = model_on()
    counts = []
    for n in (6, 9):  # (the first may find the step loaded already, for an earlier test's model of this shape)
        report = []
        compiled_generation(model, PROMPTS[:1], n, report)
        assert report[-1].startswith(COMPILED), report
        counts.append(len(exports))
    assert counts[0] <= 1 and counts[1] == counts[0], counts
    model.blocks[1].mlp.act = lambda x: torch.tanh(x)  # a function of its own: no other test's model has it
    report = []
    got = compiled_generation(model, PROMPTS[:1], 12, report)
    assert len(exports) == counts[1] + 1 and report[-1].startswith(COMPILED), (exports, report)
    assert got == generate(model, PROMPTS[:1], 12, temperature=0, stop_token=None, fast=OFF)


def test_two_generations_interleaved_each_keep_their_own_cache(native_kernels):
    """Two generators of one model share its loaded step; each call hands it the caller's cache, so stepping them
    in turn gives each what it gives alone, compiled throughout (a step run over the other's cache would disagree
    with the forward at a checked step, and decline)."""
    if not native_kernels.attend_one:
        pytest.skip(f"no attention kernel here (a step is compiled where it serves): {native_kernels.binding_why_not}")
    from gpt2port.generate import steps

    model = model_on()
    prompts, reports = (PROMPTS[0], PROMPTS[2]), ([], [])
    runs = [steps(model, [p], 12, temperature=0, stop_token=None, fast=Settings(compile=True), report=r)
            for p, r in zip(prompts, reports)]
    got = [[], []]
    for a, b in zip(*runs):
        got[0].append(int(a[0]))
        got[1].append(int(b[0]))
    assert [list(run) for run in runs] == [[], []]  # both ended: each said what its steps ran on
    for prompt, tokens, report in zip(prompts, got, reports):
        assert report[-1].startswith(COMPILED), report
        assert tokens == generate(model, [prompt], 12, temperature=0, stop_token=None, fast=OFF)[0]


@pytest.mark.heavy  # a second compile
def test_a_compiled_step_is_compiled_again_once_the_model_changed(native_kernels):
    if not native_kernels.attend_one:
        pytest.skip(f"no attention kernel here (a step is compiled where it serves): {native_kernels.binding_why_not}")
    model = model_on()
    compiled_generation(model, PROMPTS[:1], 4, [])
    model.blocks[1].mlp.act = torch.tanh  # what the model computes changed after it was compiled
    report = []
    got = compiled_generation(model, PROMPTS[:1], 20, report)
    assert report[-1].startswith(COMPILED), report
    assert got == generate(model, PROMPTS[:1], 20, temperature=0, stop_token=None, fast=OFF)


class FrozenPosition(GPT):
    """A forward that reads its position's value in Python, which a compiled graph cannot hold."""

    def embed(self, idx, pos=0, pad=None):
        return super().embed(idx, int(pos) if isinstance(pos, torch.Tensor) else pos, pad)


def test_a_forward_that_cannot_be_compiled_decodes_as_it_is_and_says_why(native_kernels):
    if not native_kernels.attend_one:
        pytest.skip(f"no attention kernel here (a step is compiled where it serves): {native_kernels.binding_why_not}")
    model = make_realistic_(FrozenPosition(CONFIG), seed=0).eval()
    report = []
    got = compiled_generation(model, PROMPTS[:1], 12, report)
    assert report[-1].startswith("the model's forward (not compiled: "), report
    assert got == generate(model, PROMPTS[:1], 12, temperature=0, stop_token=None, fast=OFF)


def test_compiling_declines_hooks_training_a_batch_and_int8_and_says_why(native_kernels, tmp_path):
    if not native_kernels.attend_one:
        pytest.skip(f"no attention kernel here (a step is compiled where it serves): {native_kernels.binding_why_not}")
    model = model_on()
    cache, attention = new_cache(CONFIG, 1, 20, torch.float32, "cpu", None, Settings())
    hook = model.blocks[0].register_forward_hook(lambda *a: None)
    try:
        assert "no compile: it has forward hooks" in decode_step(model, cache, Settings(compile=True)).description
    finally:
        hook.remove()
    assert "no compile: the model is in training mode" in \
        decode_step(model.train(), cache, Settings(compile=True)).description
    report = []
    generate(model.eval(), PROMPTS, 3, temperature=0, fast=Settings(compile=True), report=report)
    assert "(no compile: attention is not on gpt2port's kernel" in report[-1], report
    model.save_pretrained(tmp_path / "ckpt")
    int8 = GPT.from_pretrained(tmp_path / "ckpt", dtype="int8")
    generate(int8, PROMPTS[:1], 3, temperature=0, fast=Settings(compile=True), report=report)
    assert "(no compile: int8's one-row products take fbgemm's packed weights" in report[-1], report
    assert decode_step(model, cache, Settings(replay=False)).description == "the model's forward"  # not asked for


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_graph_generates_what_the_forward_does(dtype):
    model = model_on("cuda", dtype)
    report = []
    got = generate(model, PROMPTS, 12, temperature=0, stop_token=None, fast=Settings(cuda_graph=True), report=report)
    assert report[-1].startswith("the model's forward, recorded as a CUDA graph"), report
    assert got == generate(model, PROMPTS, 12, temperature=0, stop_token=None, fast=OFF)


@cuda
def test_the_graph_declines_hooks_and_training_and_says_why():
    model = model_on("cuda")
    hook = model.blocks[0].register_forward_hook(lambda *a: None)
    try:
        report = []
        generate(model, PROMPTS, 3, temperature=0, fast=Settings(cuda_graph=True), report=report)
        assert "no CUDA graph: it has forward hooks" in report[-1], report
    finally:
        hook.remove()
    cache = KVCache(CONFIG, 1, 8, device="cuda")
    assert "training mode" in decode_step(model.train(), cache, Settings(cuda_graph=True)).description
