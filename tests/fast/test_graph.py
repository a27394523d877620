"""The decode step (gpt2port/fast/graph.py): the model's forward, called as it is, traced on the CPU, or recorded as a
CUDA graph. Both captures record the forward's static-shape form (the position a tensor): that form is held to the
forward with the position a number, logits and cache, for a batch with left padding; the trace is held to the forward
token by token, and one that froze the position is caught and leaves the cache as the forward would; a graph's
recording needs a CUDA device (those tests skip without one; scripts/gpu_check.sh runs them)."""

from __future__ import annotations

import pytest
import torch

from gpt2port import GPT, GPTConfig
from gpt2port.fast import OFF, Settings, accelerate, decode_step
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
    step = decode_step(model, cache, Settings(cuda_graph=True, trace=False), "attention on SDPA (switched off)")
    assert step.description == "the model's forward; attention on SDPA (switched off)"
    with torch.inference_mode():
        model(torch.tensor([[1, 2]]), cache=cache)
        torch.testing.assert_close(step(torch.tensor([[3]]), 2),
                                   model(torch.tensor([[1, 2, 3]]))[0][:, -1:], rtol=1e-5, atol=1e-5)


def traced_model(dtype: str, tmp_path) -> GPT:
    model = model_on()
    if dtype == "int8":
        model.save_pretrained(tmp_path / "ckpt")
        return GPT.from_pretrained(tmp_path / "ckpt", dtype="int8")
    return model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_on_the_cpu_one_row_is_traced_and_generates_what_the_forward_does(dtype, tmp_path, native_kernels):
    if not native_kernels.attend_one:
        pytest.skip(f"no attention kernel here (a trace is taken where it serves): {native_kernels.binding_why_not}")
    model = traced_model(dtype, tmp_path)
    report = []
    got = generate(model, PROMPTS[:1], 30, temperature=0, stop_token=None, fast=Settings(), report=report)
    assert report[-1].startswith("the model's forward, traced once and replayed"), report
    assert got == generate(model, PROMPTS[:1], 30, temperature=0, stop_token=None, fast=OFF)
    # a batch's attention is not on the kernel: not traced, and said why
    generate(model, PROMPTS, 3, temperature=0, fast=Settings(), report=report)
    assert "(no trace: attention is not on gpt2port's kernel" in report[-1], report


class FrozenPosition(GPT):
    """A forward that reads its position's value in Python: a trace holds the number it read."""

    def embed(self, idx, pos=0, pad=None):
        return super().embed(idx, int(pos) if isinstance(pos, torch.Tensor) else pos, pad)


def test_a_trace_that_froze_the_position_is_caught_and_the_cache_kept(native_kernels):
    if not native_kernels.attend_one:
        pytest.skip(f"no attention kernel here (a trace is taken where it serves): {native_kernels.binding_why_not}")
    model = make_realistic_(FrozenPosition(CONFIG), seed=0).eval()
    accelerate(model, Settings())
    tokens = torch.tensor([PROMPTS[0]])
    cache, attention = new_cache(CONFIG, 1, 20, torch.float32, "cpu", None, Settings())
    plain = KVCache(CONFIG, 1, 20)
    step = decode_step(model, cache, Settings(), attention)
    with torch.inference_mode():
        for c in (cache, plain):
            model(tokens, cache=c)
        for pos in range(7, 11):
            nxt = torch.tensor([[pos * 3]])
            torch.testing.assert_close(step(nxt, pos), model(nxt, cache=plain, pos=pos, logits_to_keep=1)[0],
                                       rtol=1e-5, atol=1e-5)
    assert step.description.startswith("the model's forward (not traced: its trace disagreed with it at position 8)")
    torch.testing.assert_close(cache.k, plain.k, rtol=1e-5, atol=1e-5)  # the wrong replay's writes were undone


def test_a_trace_is_kept_for_the_model_and_taken_again_once_the_model_changed(native_kernels):
    """A later generation replays the trace an earlier one took (any length: the cache is an input), after checking
    it at its first step; once the model computes something else, that check sends it back to be traced again."""
    if not native_kernels.attend_one:
        pytest.skip(f"no attention kernel here (a trace is taken where it serves): {native_kernels.binding_why_not}")
    from gpt2port.fast import graph

    model = model_on()
    for prompt, n in ((PROMPTS[0][:2], 4), (PROMPTS[0], 20)):
        report = []
        got = generate(model, [prompt], n, temperature=0, stop_token=None, report=report)
        assert report[-1].startswith("the model's forward, traced once and replayed"), report
        assert got == generate(model, [prompt], n, temperature=0, stop_token=None, fast=Settings(trace=False))
    kept = list(graph._TRACES[model].values())
    assert len(kept) == 1  # one trace, taken by the first generation, replayed by the second
    model.blocks[1].mlp.act = torch.tanh  # what the model computes changed after it was traced
    got = generate(model, [PROMPTS[0]], 20, temperature=0, stop_token=None)
    assert got == generate(model, [PROMPTS[0]], 20, temperature=0, stop_token=None, fast=Settings(trace=False))
    assert list(graph._TRACES[model].values()) != kept  # traced again


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_a_kept_trace_does_not_keep_its_model_alive(dtype, tmp_path, native_kernels):
    import gc
    import weakref

    from gpt2port.fast import graph

    if not native_kernels.attend_one:
        pytest.skip(f"no attention kernel here (a trace is taken where it serves): {native_kernels.binding_why_not}")
    model = traced_model(dtype, tmp_path)
    generate(model, PROMPTS[:1], 4, temperature=0, stop_token=None)
    assert model in graph._TRACES
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_the_trace_declines_hooks_and_training_and_says_why(native_kernels):
    if not native_kernels.attend_one:
        pytest.skip(f"no attention kernel here (a trace is taken where it serves): {native_kernels.binding_why_not}")
    model = model_on()
    cache, attention = new_cache(CONFIG, 1, 20, torch.float32, "cpu", None, Settings())
    hook = model.blocks[0].register_forward_hook(lambda *a: None)
    try:
        assert "no trace: it has forward hooks" in decode_step(model, cache, Settings()).description
    finally:
        hook.remove()
    assert "no trace: the model is in training mode" in decode_step(model.train(), cache, Settings()).description


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
