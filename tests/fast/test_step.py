"""The decode step (gpt2port/fast/step.py) against the model's forward: the same logits and the same cache, for every
kernel, dtype, activation, batch and padding; the model's forward wherever the step cannot be the model (a subclass,
hooks, training, autograd). Its fixed shapes make it recordable as a CUDA graph: on the CPU the operators it runs are
checked to be the same at every position; the recording itself needs a CUDA device (those tests skip without one,
and scripts/gpu_check.sh runs them)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from gpt2port import GPT, GPTConfig, quant
from gpt2port.fast import OFF, Settings, accelerate, decode_step
from gpt2port.fast.step import Step, applies
from gpt2port.generate import decode, generate
from gpt2port.model import KVCache

CONFIG = GPTConfig(n_layer=3, n_head=4, n_embd=32, vocab_size=300, n_positions=48)
PROMPTS = [[5, 17, 250, 3, 99, 12, 7], [42], [8, 8, 9, 100]]  # different lengths: rows 1 and 2 are left-padded
pytestmark = pytest.mark.usefixtures("one_thread")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def lively_model(config: GPTConfig = CONFIG, seed: int = 0) -> GPT:
    """Random weights scaled up, so each step's logits move (a near-constant model would hide a wrong cache)."""
    torch.manual_seed(seed)
    model = GPT(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(5.0)
            elif "norm" in name or ".ln" in name:  # gains and biases of the norms away from 1 and 0
                p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


def int8_model(tmp_path, model: GPT) -> GPT:
    model.save_pretrained(tmp_path / "ckpt")
    return GPT.from_pretrained(tmp_path / "ckpt", dtype="int8")


def run_both(model: GPT, prompt: torch.Tensor, steps: int, settings: Settings, pad: torch.Tensor | None = None,
             tolerance: float = 1e-5) -> str:
    """Prefill two caches alike, then step one through the model's forward and one through the fast step, both with
    the same kernels swapped in; compare logits and caches. Returns the step's description."""
    dtype = torch.float32 if model.quantized else model.tok_emb.weight.dtype
    accelerate(model, settings)
    with torch.inference_mode():
        caches = [KVCache(model.config, prompt.size(0), prompt.size(1) + steps, dtype, pad=pad) for _ in range(2)]
        logits = [model(prompt, cache=c, last_only=True) for c in caches]
        step = decode_step(model, caches[1], settings)
        assert isinstance(step, Step), step.description
        for _ in range(steps):
            nxt = logits[0][:, -1].argmax(-1, keepdim=True)
            logits = [model(nxt, cache=caches[0], last_only=True), step(nxt)]
            assert logits[1].shape == logits[0].shape
            torch.testing.assert_close(logits[1], logits[0], rtol=tolerance, atol=tolerance)
            assert caches[1].length == caches[0].length
        torch.testing.assert_close(caches[1].k, caches[0].k, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(caches[1].v, caches[0].v, rtol=tolerance, atol=tolerance)
    return step.description


def prompt(batch: int = 1, length: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


KERNELS = {"gpt2port's kernels": Settings(), "oneDNN": Settings(native=False),
           "F.linear": dataclasses.replace(OFF, step=True)}


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("activation", ["gelu_new", "gelu", "relu", "silu"])
def test_fp32_every_kernel_and_activation(kernels, activation):
    run_both(lively_model(dataclasses.replace(CONFIG, activation=activation)), prompt(), 8, KERNELS[kernels])


def test_unscaled_attention_a_wider_mlp_and_an_untied_head():
    config = dataclasses.replace(CONFIG, scale_attn_weights=False, n_inner=48, layer_norm_epsilon=1e-3,
                                 tie_word_embeddings=False)
    run_both(lively_model(config), prompt(), 8, Settings())


@pytest.mark.parametrize("kernels", ["gpt2port's kernels", "F.linear"])
def test_bf16(kernels):
    run_both(lively_model().to(torch.bfloat16), prompt(), 6, KERNELS[kernels], tolerance=3e-2)


def test_a_left_padded_batch_fp32_and_bf16():
    run_both(lively_model(), prompt(batch=3), 8, Settings(), pad=torch.tensor([0, 3, 1]))
    run_both(lively_model().to(torch.bfloat16), prompt(batch=2), 6, Settings(), pad=torch.tensor([2, 0]),
             tolerance=3e-2)


def test_int8_one_row_and_batches(tmp_path):
    model = int8_model(tmp_path, lively_model())
    run_both(model, prompt(), 8, Settings())
    run_both(model, prompt(batch=2), 4, Settings(), pad=torch.tensor([1, 0]))


def test_int8_smoothed_against_outlier_channels(tmp_path):
    """Products smoothed at load (gpt2port.quant: their inputs divided by s on the way to fbgemm) in the step too."""
    if not quant._fbgemm_works():
        pytest.skip("this PyTorch has no working fbgemm")
    model = lively_model()
    with torch.no_grad():
        for block in model.blocks:
            block.ln1.weight[:2] *= 30
            block.ln2.weight[3:5] *= 30
    model = int8_model(tmp_path, model)
    assert any(m.in_scale is not None for m in model.modules() if isinstance(m, quant.Int8Linear))
    run_both(model, prompt(), 8, Settings())


class Subclass(GPT):
    pass


def test_what_the_step_cannot_reproduce_gets_the_models_forward():
    model = lively_model()
    cache = KVCache(model.config, 1, 8)
    assert applies(model, cache) is None
    assert applies(Subclass(CONFIG).eval(), cache) == "a Subclass, not a GPT"  # a subclass may compute otherwise
    model.blocks[1].mlp.train()
    assert applies(model, cache) == "the model is in training mode"
    model.eval()
    model.blocks[0].attn = nn.Identity().eval()  # a module of the block's composition swapped for another kind
    assert applies(model, cache) == "its blocks are not gpt2port's own"
    step = decode_step(lively_model(), cache, Settings(step=False))
    assert step.description == "the model's forward (switched off)"


def test_a_norm_of_another_kind_gets_the_models_forward():
    """The step computes norms as nn.LayerNorm does rather than calling them: a model with another norm is left to
    its own forward, and generates what that forward does."""
    class Scaled(nn.LayerNorm):
        def forward(self, x):
            return 2 * super().forward(x)

    model = lively_model()
    model.blocks[1].ln2.__class__ = Scaled
    assert applies(model, KVCache(model.config, 1, 8)) == "its norms, dropouts or position table are not PyTorch's own"
    ref = generate(model, [[1, 2, 3]], max_new_tokens=6, temperature=0, stop_token=None, fast=Settings(step=False))
    assert generate(model, [[1, 2, 3]], max_new_tokens=6, temperature=0, stop_token=None) == ref


def test_the_int8_step_calls_its_kernels_not_the_layers(tmp_path, monkeypatch):
    """Each product of a one-row step is bound to fbgemm's kernel once per generation (quant.Int8Linear.bound), not
    routed through the layer's forward per call; the numbers are the forward's (test_int8_one_row_and_batches)."""
    if not quant._fbgemm_works():
        pytest.skip("this PyTorch has no working fbgemm")
    model = int8_model(tmp_path, lively_model())
    calls = []
    forward = quant.Int8Linear.forward
    monkeypatch.setattr(quant.Int8Linear, "forward", lambda self, x: calls.append(x.shape) or forward(self, x))
    accelerate(model, Settings())
    with torch.inference_mode():
        cache = KVCache(model.config, 1, 12, torch.float32)
        model(prompt(), cache=cache, last_only=True)
        step = decode_step(model, cache, Settings())
        calls.clear()
        step(torch.tensor([[4]]))
    assert calls == []


def test_hooks_still_run_during_generation():
    model = lively_model()
    calls, report = [], []
    handle = model.blocks[2].mlp.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[1]))
    try:
        generate(model, [[1, 2, 3]], max_new_tokens=4, temperature=0, stop_token=None, report=report)
        assert report == ["the model's forward (it has forward hooks)"]  # what `generate --verbose` reports
    finally:
        handle.remove()
    assert calls == [3, 1, 1, 1]
    generate(model, [[1, 2, 3]], max_new_tokens=2, temperature=0, stop_token=None, report=report)
    assert report[-1].startswith("gpt2port.fast's step")
    handle = nn.modules.module.register_module_forward_hook(lambda mod, args, out: None)  # global hooks too
    try:
        assert applies(model, KVCache(model.config, 1, 8)) == "it has forward hooks"
    finally:
        handle.remove()


def test_under_autograd_the_step_is_the_models_forward():
    model = lively_model()
    cache = KVCache(model.config, 1, 8)
    with torch.inference_mode():
        model(prompt(), cache=cache)
    step = decode_step(model, cache, Settings())
    calls, forward = [], model.forward
    model.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    with torch.no_grad():
        step(torch.tensor([[4]]))
    assert calls == []  # the step
    with torch.enable_grad():
        assert step(torch.tensor([[4]])).requires_grad
    assert calls == [1]  # the model's own


def decoded(model: GPT, prompts, n: int, settings: Settings, keep: int | None = None):
    tokens, logits = [], []
    for nxt, step_logits in decode(model, prompts, n, temperature=0, stop_token=None, keep=keep, fast=settings):
        tokens.append(nxt.tolist())
        logits.append(step_logits.float().cpu().clone())
    return [list(row) for row in zip(*tokens)], logits


@pytest.mark.parametrize("settings", [Settings(), Settings(native=False)], ids=["gpt2port's kernels", "oneDNN"])
def test_generation_slides_and_pads_as_the_models_forward(settings):
    """Through generate's loop, the step's position and padding follow every prefill, the first and each after the
    48-token context slid (3 slides in 100 tokens), on a padded batch and one row; and generate leaves the model as
    it was (its layers swapped back)."""
    model = lively_model()
    for prompts in (PROMPTS, PROMPTS[:1]):
        ref_tokens, ref_logits = decoded(model, prompts, 100, dataclasses.replace(settings, step=False), keep=20)
        tokens, logits = decoded(model, prompts, 100, settings, keep=20)
        assert tokens == ref_tokens
        for got, ref in zip(logits, ref_logits):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert {type(m) for m in model.modules() if isinstance(m, nn.Linear)} == {nn.Linear}


def test_accelerate_keeps_every_parameter_and_the_tied_head():
    model = lively_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    accelerate(model, Settings())
    assert [id(p) for p in model.parameters()] == params and model.lm_head.weight is model.tok_emb.weight
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.inference_mode():
        x = prompt(batch=2)
        torch.testing.assert_close(model(x), accelerate(lively_model(), OFF)(x), rtol=1e-5, atol=1e-5)


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


def test_the_step_is_recordable():
    """What makes a step a graph, checked on the CPU (with the kernels a GPU would have: PyTorch's): at any position
    and padding it runs the very same operators on the very same shapes, and none reads a tensor's value back into
    Python (a host synchronization, which recording forbids: .item(), bool(), nonzero)."""
    model = lively_model()
    L = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in PROMPTS])
    pad = torch.tensor([L - len(p) for p in PROMPTS])
    runs = []
    with torch.inference_mode():
        cache = KVCache(CONFIG, len(PROMPTS), 40, pad=pad)
        model(ids, cache=cache, last_only=True)
        step = decode_step(model, cache, dataclasses.replace(OFF, step=True))
        for length, new_pad in ((cache.length, pad), (30, pad), (12, torch.tensor([0, 5, 1]))):
            cache.length = length
            cache.pad = new_pad
            step.sync()
            with Recorded() as seen:
                step.forward()
            runs.append(seen.ops)
    assert runs[0] == runs[1] == runs[2]
    names = {op for op, _ in runs[0]}
    assert not names & {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default",
                        "aten.item.default"}
    assert "aten.index_copy_.default" in names  # the keys written at the position tensor, not at a Python int


def test_the_cuda_graph_is_opt_in(monkeypatch):
    monkeypatch.delenv("GPT2PORT_CUDA_GRAPH", raising=False)
    assert Settings().cuda_graph is False and Settings.from_env().cuda_graph is False
    monkeypatch.setenv("GPT2PORT_CUDA_GRAPH", "1")
    assert Settings.from_env().cuda_graph is True


# --- on a CUDA device -------------------------------------------------------------------------------------------------

GRAPH = Settings(cuda_graph=True)


@cuda
@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["one row", "padded batch"])
def test_graph_decodes_as_the_model_on_cuda(prompts):
    model = lively_model().cuda()
    ref_tokens, ref_logits = decoded(model, prompts, 100, Settings(step=False), keep=20)
    report = []
    generate(model, prompts, 100, temperature=0, stop_token=None, keep=20, fast=GRAPH, report=report)
    assert report == ["a CUDA graph of gpt2port.fast's step (attention: SDPA)"]  # recorded, not a silent fallback
    tokens, logits = decoded(model, prompts, 100, GRAPH, keep=20)
    assert tokens == ref_tokens
    for got, ref in zip(logits, ref_logits):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@cuda
def test_graph_in_bf16_and_logits_kept_across_steps():
    model = lively_model().to("cuda", torch.bfloat16)
    ref = generate(model, PROMPTS, 20, temperature=0, stop_token=None, fast=Settings(step=False))
    report = []
    got = generate(model, PROMPTS, 20, temperature=0, stop_token=None, fast=GRAPH, report=report)
    assert report[0].startswith("a CUDA graph")
    assert [r[:3] for r in got] == [r[:3] for r in ref]  # bf16 may flip a near-tie later on
    # The logits each step yields stay as they were after the next replay (the graph's output is copied out).
    kept = [lg for _, lg in decode(model, PROMPTS, 5, temperature=0, stop_token=None, fast=GRAPH)]
    again = [lg.clone() for _, lg in decode(model, PROMPTS, 5, temperature=0, stop_token=None, fast=GRAPH)]
    for a, b in zip(kept, again):
        torch.testing.assert_close(a, b)
