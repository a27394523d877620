"""The scripted decode step (gpt2port/decode_step.py) against the model's own forward: the same logits and the same
cache, bit for bit, for every kernel, activation, batch and padding it takes; the model's forward wherever it cannot
be the model (a subclass, hooks, training, autograd, int8 batches)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import gpt2port.decode_step as decode_step
import gpt2port.kernels as kernels
from gpt2port import GPT, GPTConfig, native, quant
from gpt2port.decode_step import FBGEMM, NATIVE, ONEDNN, PLAIN, _kind, _scripted_step, stepper
from gpt2port.generate import generate
from gpt2port.model import KVCache

CONFIG = GPTConfig(n_layer=3, n_head=4, n_embd=32, vocab_size=300, n_positions=48)


pytestmark = pytest.mark.usefixtures("one_thread")


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


def run_both(model: GPT, prompt: torch.Tensor, steps: int, pad: torch.Tensor | None = None, expect: str | None = None):
    """Prefill two caches alike, then step one through the model's forward and one through stepper(); compare."""
    dtype = torch.float32 if getattr(model, "quantized", None) else model.tok_emb.weight.dtype
    with torch.inference_mode():
        caches = [KVCache(model.config, prompt.size(0), prompt.size(1) + steps, dtype, pad=pad) for _ in range(2)]
        logits = [model(prompt, cache=c, last_only=True) for c in caches]
        if expect is not None:
            assert _kind(model, caches[1]) == expect
            attend = kernels.attention_kernel_takes(caches[1])
            assert _scripted_step(model, expect, attend) is not None  # scripting worked: the step below is it
        step = stepper(model, caches[1])
        for _ in range(steps):
            nxt = logits[0][:, -1].argmax(-1, keepdim=True)
            logits = [model(nxt, cache=caches[0], last_only=True), step(nxt)]
            assert logits[1].shape == logits[0].shape
            assert torch.equal(logits[1], logits[0])
            assert caches[1].length == caches[0].length
        assert torch.equal(caches[1].k, caches[0].k) and torch.equal(caches[1].v, caches[0].v)


def prompt(batch: int = 1, length: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def one_row_fp32() -> str:
    """The kernel one row of fp32 takes here, as the model's Linear chooses it."""
    return NATIVE if native.available() else ONEDNN if kernels.onednn_linear_enabled() else PLAIN


@pytest.mark.parametrize("activation", ["gelu_new", "gelu", "relu", "silu"])
def test_fp32_on_gpt2ports_kernel_every_activation(activation):
    if not native.available():
        pytest.skip(f"gpt2port's one-row kernel is not available: {native.why_not()}")
    run_both(lively_model(dataclasses.replace(CONFIG, activation=activation)), prompt(), 8, expect=NATIVE)


@pytest.mark.parametrize("activation", ["gelu_new", "silu"])
def test_fp32_on_onednn(activation, monkeypatch):
    if not kernels.onednn_linear_enabled():
        pytest.skip("this PyTorch has no oneDNN linear")
    monkeypatch.setattr(native, "ENABLED", False)
    run_both(lively_model(dataclasses.replace(CONFIG, activation=activation)), prompt(), 8, expect=ONEDNN)


def test_fp32_on_f_linear_unscaled_attention_and_a_wider_mlp(monkeypatch):
    monkeypatch.setattr(kernels, "USE_ONEDNN", False)
    monkeypatch.setattr(native, "ENABLED", False)
    config = dataclasses.replace(CONFIG, scale_attn_weights=False, n_inner=48, layer_norm_epsilon=1e-3)
    run_both(lively_model(config), prompt(), 8, expect=PLAIN)


def test_an_untied_head():
    run_both(lively_model(dataclasses.replace(CONFIG, tie_word_embeddings=False)), prompt(), 6, expect=one_row_fp32())


def test_bf16():
    run_both(lively_model().to(torch.bfloat16), prompt(), 6, expect=NATIVE if native.available() else PLAIN)


def test_bf16_on_f_linear(monkeypatch):
    monkeypatch.setattr(native, "ENABLED", False)
    run_both(lively_model().to(torch.bfloat16), prompt(), 6, expect=PLAIN)


def test_a_bf16_batch():
    pad = torch.tensor([2, 0])
    run_both(lively_model().to(torch.bfloat16), prompt(batch=2), 6, pad=pad, expect=PLAIN)


def test_a_left_padded_batch():
    pad = torch.tensor([0, 3, 1])
    run_both(lively_model(), prompt(batch=3), 8, pad=pad, expect=ONEDNN if kernels.onednn_linear_enabled() else PLAIN)


def test_int8_on_fbgemm(tmp_path):
    if not quant._fbgemm_works():
        pytest.skip("this PyTorch has no working fbgemm")
    run_both(int8_model(tmp_path, lively_model()), prompt(), 8, expect=FBGEMM)


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
    run_both(model, prompt(), 8, expect=FBGEMM)


def test_int8_batches_keep_the_models_forward(tmp_path):
    """Int8Linear runs several rows on another kernel than one: a batch is left to the model's own forward."""
    run_both(int8_model(tmp_path, lively_model()), prompt(batch=2), 4, expect=None)
    model = int8_model(tmp_path / "again", lively_model())
    assert _kind(model, KVCache(model.config, 2, 8)) is None


class Subclass(GPT):
    pass


class ScaledEmbedding(nn.Embedding):
    def forward(self, idx):
        return super().forward(idx) * 2.0


def test_what_the_step_cannot_reproduce_gets_the_models_forward():
    model = lively_model()
    cache = KVCache(model.config, 1, 8)
    assert _kind(model, cache) is not None
    sub = Subclass(CONFIG).eval()
    assert _kind(sub, KVCache(sub.config, 1, 8)) is None  # a subclass may compute otherwise
    model.blocks[1].mlp.train()
    assert _kind(model, cache) is None  # any module in training mode
    model.eval()
    model.blocks[0].ln2 = nn.RMSNorm(CONFIG.n_embd)  # a module swapped for another kind
    assert _kind(model, cache) is None
    model = lively_model()
    model.tok_emb = ScaledEmbedding(CONFIG.vocab_size, CONFIG.n_embd)  # the embedding too
    assert _kind(model, cache) is None


def test_hooks_still_run_during_generation():
    model = lively_model()
    calls = []
    handle = model.blocks[2].mlp.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[1]))
    try:
        generate(model, [[1, 2, 3]], max_new_tokens=4, temperature=0, stop_token=None)
        assert decode_step.last_path == "the model's forward"  # what `generate --verbose` reports
    finally:
        handle.remove()
    assert calls == [3, 1, 1, 1]
    generate(model, [[1, 2, 3]], max_new_tokens=2, temperature=0, stop_token=None)
    assert decode_step.last_path.startswith("TorchScript (")
    handle = nn.modules.module.register_module_forward_hook(lambda mod, args, out: None)  # global hooks too
    try:
        assert _kind(model, KVCache(model.config, 1, 8)) is None
    finally:
        handle.remove()


def test_under_autograd_the_step_is_the_models_forward():
    model = lively_model()
    cache = KVCache(model.config, 1, 8)
    with torch.inference_mode():
        model(prompt(), cache=cache)
    step = stepper(model, cache)
    calls, forward = [], model.forward
    model.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    with torch.no_grad():
        step(torch.tensor([[4]]))
    assert calls == []  # the scripted step
    with torch.enable_grad():
        assert step(torch.tensor([[4]])).requires_grad
    assert calls == [1]  # the model's own


def test_generation_is_the_same_with_and_without_the_step(monkeypatch):
    """Sampling with a seed, a padded batch and a window that slides (the cache is reset under the step)."""
    import gpt2port.decode_step as decode_step

    model = lively_model()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13]]
    kwargs = dict(max_new_tokens=70, temperature=0.9, top_k=40, seed=3, stop_token=None, keep=20)
    built, scripted_step = [], decode_step._scripted_step
    monkeypatch.setattr(decode_step, "_scripted_step",
                        lambda *args: built.append(scripted_step(*args)) or built[-1])
    fast = generate(model, prompts, **kwargs)
    assert len(built) == 1 and built[0] is not None  # generation did take the scripted step
    monkeypatch.setattr(decode_step, "SCRIPTED", False)  # the switch: every step through the model's forward
    assert fast == generate(model, prompts, **kwargs)
    assert len(built) == 1  # not even attempted
    assert all(len(row) == 70 for row in fast)


def test_a_model_reuses_its_scripted_step_while_it_would_be_built_the_same(monkeypatch):
    from gpt2port.generate import decode

    model, built, script = lively_model(), [], torch.jit.script
    # (scripting a step scripts some of PyTorch's own functions too, once a process: only steps are counted)
    monkeypatch.setattr(torch.jit, "script", lambda obj, *args, **kwargs: (
        isinstance(obj, decode_step._Step) and built.append(obj)) or script(obj, *args, **kwargs))

    def logits(scripted: bool = True) -> list[torch.Tensor]:
        monkeypatch.setattr(decode_step, "SCRIPTED", scripted)
        return [step[1].clone() for step in decode(model, [[1, 2, 3]], 5, temperature=0, stop_token=None)]

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    first = logits()
    assert decode_step.last_path.startswith("TorchScript")  # the scripted step, not the model's forward
    assert same(logits(), first) and len(built) == 1  # the second generation: the same step, not scripted again
    weight = model.blocks[1].mlp.fc.weight
    with torch.no_grad():
        weight.mul_(-1.0)  # changed in place: the step holds the tensor itself, and sees it
    changed = logits()
    assert len(built) == 1 and not same(changed, first) and same(changed, logits(scripted=False))
    model.blocks[1].mlp.fc.weight = nn.Parameter(weight.detach() * 0.5)  # replaced: a step of the new tensor
    assert same(logits(), logits(scripted=False)) and len(built) == 2
    model.blocks[1].mlp.fc.weight.data = weight.detach() * 2  # the same Parameter, its numbers elsewhere
    assert same(logits(), logits(scripted=False)) and len(built) == 3
    attended = kernels.attention_kernel_takes(KVCache(model.config, 1, 8))
    monkeypatch.setattr(kernels, "ATTEND_ONE", False)  # attention alone on another kernel
    assert same(logits(), logits(scripted=False)) and len(built) == 3 + attended
    monkeypatch.setattr(native, "ENABLED", False)  # products (and attention) on other kernels: another step
    assert same(logits(), logits(scripted=False)) and len(built) == 4 + attended
    kind = _kind(model, KVCache(model.config, 1, 8))
    monkeypatch.setattr(kernels, "USE_ONEDNN", False)  # the products' kernel alone
    assert same(logits(), logits(scripted=False)) and len(built) == 4 + attended + (
        _kind(model, KVCache(model.config, 1, 8)) != kind)
    model.config = dataclasses.replace(model.config, layer_norm_epsilon=1e-3)  # a setting the step copies
    for block in model.blocks:
        block.ln1.eps = block.ln2.eps = 1e-3
    model.final_norm.eps = 1e-3
    before = len(built)
    assert same(logits(), logits(scripted=False)) and len(built) == before + 1
