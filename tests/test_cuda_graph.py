"""The decode step recorded as a CUDA graph (gpt2port/cuda_graph.py). Its fixed-shape step (StaticStep: the position
as a tensor, keys written by index, attention over every slot behind a mask) runs on the CPU too, without a graph:
there its logits and cache are held to the model's forward, through batches, left padding and the context sliding.
The recording itself needs a CUDA device: those tests are skipped without one."""

from __future__ import annotations

import os

import pytest
import torch

import gpt2port.cuda_graph as cuda_graph
import gpt2port.decode_step as decode_step
from gpt2port import GPT, GPTConfig
from gpt2port.cuda_graph import StaticStep
from gpt2port.generate import decode, generate
from gpt2port.model import KVCache
from tests.test_decode_step import lively_model

CONFIG = GPTConfig(n_layer=3, n_head=4, n_embd=32, vocab_size=300, n_positions=48)
PROMPTS = [[5, 17, 250, 3, 99, 12, 7], [42], [8, 8, 9, 100]]  # different lengths: rows 1 and 2 are left-padded
pytestmark = pytest.mark.usefixtures("one_thread")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def padded(prompts: list[list[int]], device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    L = max(map(len, prompts))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts], device=device)
    return ids, torch.tensor([L - len(p) for p in prompts], device=device)


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one row", "padded batch"])
def test_static_step_is_the_models_forward(prompts):
    model = lively_model(CONFIG)
    ids, pad = padded(prompts)
    steps = 12
    with torch.inference_mode():
        caches = [KVCache(CONFIG, len(prompts), ids.size(1) + steps, pad=pad) for _ in range(2)]
        logits = [model(ids, cache=c, last_only=True)[:, -1] for c in caches]
        static = StaticStep(model, caches[1])
        for _ in range(steps):
            nxt = logits[0].argmax(-1, keepdim=True)
            ref = model(nxt, cache=caches[0], last_only=True)[:, -1]
            got = static(nxt)
            caches[1].length += 1
            assert got.shape == ref.shape
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            logits = [ref, got]
        end = caches[0].length
        assert caches[1].length == end
        torch.testing.assert_close(caches[1].k[..., :end, :], caches[0].k[..., :end, :], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(caches[1].v[..., :end, :], caches[0].v[..., :end, :], rtol=1e-6, atol=1e-6)


def decoded(model: GPT, prompts, n: int, keep: int | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    tokens, logits = [], []
    for nxt, step_logits in decode(model, prompts, n, temperature=0, stop_token=None, keep=keep):
        tokens.append(nxt.tolist())
        logits.append(step_logits.float().cpu().clone())
    return [list(row) for row in zip(*tokens)], logits


def test_generate_on_the_static_step_slides_and_pads_as_the_model(monkeypatch):
    """Through generate's loop, with the static step standing in for the scripted one on the CPU: its position and
    padding follow every prefill, the first and each after the 48-token context slid (3 slides in 100 tokens)."""
    model = lively_model(CONFIG)
    monkeypatch.setattr(decode_step, "SCRIPTED", False)
    ref_tokens, ref_logits = decoded(model, PROMPTS, 100, keep=20)
    made = []

    def static_call(model, cache, *kernels):
        made.append(StaticStep(model, cache))
        return made[-1]

    monkeypatch.setattr(decode_step, "_scripted_call", static_call)
    tokens, logits = decoded(model, PROMPTS, 100, keep=20)
    assert len(made) == 1 and made[0].graph is None
    assert tokens == ref_tokens
    for got, ref in zip(logits, ref_logits):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


class Subclass(GPT):
    pass


@pytest.mark.parametrize("change", ["none", "subclass", "training", "hook", "global hook"])
def test_which_models_get_the_graph(monkeypatch, change):
    """The graph is recorded only for a model StaticStep writes out exactly (asked of a CPU model here, with the
    recording itself replaced)."""
    model = lively_model(CONFIG)
    if change == "subclass":
        model = Subclass(CONFIG).eval()
    elif change == "training":
        model.blocks[1].train()
    elif change == "hook":
        model.blocks[2].mlp.register_forward_hook(lambda *a: None)
    elif change == "global hook":
        handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    monkeypatch.setattr(cuda_graph, "graphed_step", lambda model, cache: "recorded")
    try:
        with torch.inference_mode():
            got = decode_step._graphed_step(model, KVCache(CONFIG, 1, 8))
    finally:
        if change == "global hook":
            handle.remove()
    assert got == ("recorded" if change == "none" else None)


def test_the_environment_switches_graphs_off():
    import subprocess
    import sys

    code = "import gpt2port.cuda_graph as g; print(g.ENABLED)"
    for value, expected in (("0", "False"), ("1", "True")):
        env = {**os.environ, "GPT2PORT_CUDA_GRAPH": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
        assert out.strip() == expected


def test_graphed_step_needs_a_cuda_device():
    model = lively_model(CONFIG)
    with torch.inference_mode():
        assert cuda_graph.graphed_step(model, KVCache(CONFIG, 1, 8)) is None


# --- on a CUDA device -------------------------------------------------------------------------------------------------

def recorded_steps(monkeypatch) -> list:
    """The steps generate records from here on (each must have a graph: not a silent fallback)."""
    made = []
    real = cuda_graph.graphed_step

    def spy(model, cache):
        made.append(real(model, cache))
        return made[-1]

    monkeypatch.setattr(cuda_graph, "graphed_step", spy)
    return made


@cuda
@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one row", "padded batch"])
def test_graph_decodes_as_the_model_on_cuda(monkeypatch, prompts):
    model = lively_model(CONFIG).cuda()
    monkeypatch.setattr(cuda_graph, "ENABLED", False)
    ref_tokens, ref_logits = decoded(model, prompts, 100, keep=20)
    monkeypatch.setattr(cuda_graph, "ENABLED", True)
    made = recorded_steps(monkeypatch)
    tokens, logits = decoded(model, prompts, 100, keep=20)
    assert len(made) == 1 and made[0] is not None and made[0].graph is not None
    assert decode_step.last_path == "a CUDA graph"
    assert tokens == ref_tokens
    for got, ref in zip(logits, ref_logits):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@cuda
def test_graph_in_bf16_and_logits_kept_across_steps(monkeypatch):
    model = lively_model(CONFIG).to("cuda", torch.bfloat16)
    monkeypatch.setattr(cuda_graph, "ENABLED", False)
    ref = generate(model, PROMPTS, 20, temperature=0, stop_token=None)
    monkeypatch.setattr(cuda_graph, "ENABLED", True)
    made = recorded_steps(monkeypatch)
    got = generate(model, PROMPTS, 20, temperature=0, stop_token=None)
    assert made[0] is not None
    assert [r[:3] for r in got] == [r[:3] for r in ref]  # bf16 may flip a near-tie later on
    # The logits each step yields stay as they were after the next replay (the graph's output is copied out).
    kept = [lg for _, lg in decode(model, PROMPTS, 5, temperature=0, stop_token=None)]
    again = [lg.clone() for _, lg in decode(model, PROMPTS, 5, temperature=0, stop_token=None)]
    for a, b in zip(kept, again):
        torch.testing.assert_close(a, b)


class Recorded(torch.utils._python_dispatch.TorchDispatchMode):
    """Every operator a piece of code runs, with its inputs' shapes: what a CUDA graph would record of it."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = tuple(tuple(a.shape) for a in torch.utils._pytree.tree_leaves((args, kwargs))
                       if isinstance(a, torch.Tensor))
        self.ops.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


def test_static_step_is_recordable():
    """What makes a step a graph, checked on the CPU: at any position and padding it runs the very same operators on
    the very same shapes, and none reads a tensor's value back into Python (a host synchronization, which recording
    forbids: .item(), bool(), nonzero)."""
    model = lively_model(CONFIG)
    ids, pad = padded(PROMPTS)
    runs = []
    with torch.inference_mode():
        cache = KVCache(CONFIG, len(PROMPTS), 40, pad=pad)
        model(ids, cache=cache, last_only=True)
        static = StaticStep(model, cache)
        for length, new_pad in ((cache.length, pad), (30, pad), (12, torch.tensor([0, 5, 1]))):
            cache.length = length
            cache.pad = new_pad
            static.sync()
            with Recorded() as seen:
                static.forward()
            runs.append(seen.ops)
    assert runs[0] == runs[1] == runs[2]
    names = {op for op, _ in runs[0]}
    assert not names & {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default",
                        "aten.item.default"}
    assert "aten.index_copy_.default" in names  # the keys written at the position tensor, not at a Python int
