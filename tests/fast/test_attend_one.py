"""gpt2port's attention for one new token (gpt2port/attention.c, torch.ops.gpt2port.attend_one): its output against
PyTorch's scaled_dot_product_attention on every branch of its loops, the cache it writes, where the KV cache
generation makes (gpt2port/fast/cache.py) takes it (one token of one unpadded sequence in inference), and where it
leaves attention to PyTorch (a plain KVCache always does)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpt2port import GPT, GPTConfig
from gpt2port.fast import Settings, accelerate
from gpt2port.fast.cache import new_cache
from gpt2port.model import KVCache


@pytest.fixture
def attention_kernel(native_kernels):
    if not native_kernels.attend_one:
        pytest.skip(f"no attention kernel here: {native_kernels.binding_why_not}")


needs_kernel = pytest.mark.usefixtures("attention_kernel")
CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=48, vocab_size=203, n_positions=32)


def reference(qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int, scale):
    """What attend_one should leave in the caches and return, by PyTorch, in fp32 from the same numbers."""
    H, D = keys.size(1), keys.size(3)
    q, k, v = qkv.view(3, 1, H, 1, D).unbind(0)
    keys, values = keys.clone(), values.clone()
    keys[:, :, length], values[:, :, length] = k[:, :, 0], v[:, :, 0]
    y = F.scaled_dot_product_attention(q.float(), keys[:, :, :length + 1].float(), values[:, :, :length + 1].float(),
                                       scale=scale)
    return keys, values, y.reshape(H * D)


@needs_kernel
@pytest.mark.parametrize("D", [64, 17, 16, 80, 100, 200, 5])  # whole vectors, a tail, groups of four and more
@pytest.mark.parametrize("length", [0, 1, 38, 39])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_sdpa_and_writes_the_cache(D, length, dtype):
    g = torch.Generator().manual_seed(D * 100 + length)
    H, T = 3, 40
    keys, values = (torch.randn(1, H, T, D, generator=g).to(dtype) for _ in range(2))
    qkv = (2 * torch.randn(3 * H * D, generator=g)).to(dtype)
    for scale in (None, 1.0):
        want_keys, want_values, want = reference(qkv, keys, values, length, scale)
        got = torch.ops.gpt2port.attend_one(qkv, keys, values, length, scale)
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
        assert got.shape == (H * D,) and got.dtype == dtype
        assert torch.ops.gpt2port.attend_one(qkv.view(1, 1, -1), keys, values, length, scale).shape == (1, 1, H * D)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # the fp32 result rounded once: within half a bf16 step of it (and a little for the sums' order)
            torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-3)


@needs_kernel
def test_softmax_over_scores_far_apart_and_nan():
    """Scores spread over hundreds (the kernel's e^x gives 0 below -87, where expf's result no longer counts beside
    the largest score's 1), every softmax weight visible in the output, and a NaN key spoiling its head as in SDPA."""
    H, T, D, length = 2, 50, 64, 44  # 45 scores: two whole vectors of them and a tail
    keys, values = torch.zeros(1, H, T, D), torch.zeros(1, H, T, D)
    keys[..., 0] = torch.linspace(-300.0, 4.0, T)[torch.randperm(T, generator=torch.Generator().manual_seed(0))]
    keys[..., 1] = torch.linspace(-1.0, 1.0, T)  # softmax weights of ~1e-38 to 1, spanning the clamp
    values[..., :T, 0] = torch.arange(T, dtype=torch.float32)  # output lane 0 = sum of position * weight
    values[0, :, :, 1:] = torch.randn(H, T, D - 1, generator=torch.Generator().manual_seed(1))
    qkv = torch.zeros(3 * H * D)
    qkv[0], qkv[D] = 1.0, 30.0  # head 0: scores -300..4 apart; head 1: 30 times them
    qkv[1], qkv[D + 1] = 0.5, 0.0
    for scale in (1.0, 0.25):
        want_keys, want_values, want = reference(qkv, keys, values, length, scale)
        got = torch.ops.gpt2port.attend_one(qkv, keys.clone(), values.clone(), length, scale)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    keys[0, 1, 7, 3] = float("nan")
    got = torch.ops.gpt2port.attend_one(qkv, keys.clone(), values.clone(), length, None)
    want = reference(qkv, keys, values, length, None)[2]
    assert torch.isnan(want[D:]).all() and torch.isnan(got[D:]).all()  # head 1 read the NaN
    torch.testing.assert_close(got[:D], want[:D], rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_do_not_change_the_numbers(dtype):
    g = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(1, 12, 300, 64, generator=g).to(dtype) for _ in range(2))
    qkv = torch.randn(3 * 12 * 64, generator=g).to(dtype)
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(torch.ops.gpt2port.attend_one(qkv, keys.clone(), values.clone(), 250, None))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@needs_kernel
def test_refuses_what_it_would_read_or_write_wrong():
    keys, values, qkv = torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4), torch.zeros(24)
    bad = {
        "past the cache's room": (qkv, keys, values, 8),
        "a negative position": (qkv, keys, values, -1),
        "two sequences": (torch.zeros(48), torch.zeros(2, 2, 8, 4), torch.zeros(2, 2, 8, 4), 0),
        "a transposed cache": (qkv, keys.transpose(2, 3), values.transpose(2, 3), 0),
        "qkv of another dtype": (qkv.bfloat16(), keys, values, 0),
        "fp16": (qkv.half(), keys.half(), values.half(), 0),
        "too few numbers": (qkv[:-1], keys, values, 0),
        "not one row": (qkv.view(3, 8), keys, values, 0),
    }
    for case, (q, k, v, length) in bad.items():
        with pytest.raises(ValueError, match="gpt2port::attend_one takes 3 H D numbers"):
            torch.ops.gpt2port.attend_one(q, k, v, length, None)
    assert torch.equal(keys, torch.zeros_like(keys))  # nothing written by a refused call


@needs_kernel
def test_the_position_as_a_tensor_is_the_position_as_a_number():
    """attend_one.at (what a traced forward calls: the position read when it runs) against attend_one, and its own
    refusals of a position that is not one int64 number."""
    g = torch.Generator().manual_seed(3)
    keys, values = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(2))
    qkv = torch.randn(24, generator=g)
    for length in (0, 5, 7):
        caches = [(keys.clone(), values.clone()) for _ in range(2)]
        want = torch.ops.gpt2port.attend_one(qkv, *caches[0], length, None)
        got = torch.ops.gpt2port.attend_one.at(qkv, *caches[1], torch.tensor([length]), None)
        assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(*caches))
    for bad in (torch.tensor([1.0]), torch.tensor([1, 2]), torch.tensor([8]), torch.tensor([1], dtype=torch.int32)):
        with pytest.raises(ValueError, match="gpt2port::attend_one"):
            torch.ops.gpt2port.attend_one.at(qkv, keys, values, bad, None)


def calls(fn) -> dict[str, int]:
    """How many times fn() calls each of gpt2port's operators and PyTorch's attention (seen by the profiler)."""
    names = ("gpt2port::attend_one", "aten::scaled_dot_product_attention")
    with torch.profiler.profile() as prof:
        fn()
    return {name: sum(e.name == name for e in prof.events()) for name in names}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_takes_it_for_one_token_of_one_sequence(dtype):
    torch.manual_seed(0)
    model = GPT(CONFIG).eval().to(dtype)
    idx = torch.tensor([[5, 17, 101, 3, 9]])
    L, tolerance = CONFIG.n_layer, 1e-5 if dtype == torch.float32 else 3e-2
    descriptions = []

    def decode(batch=1, pad=None, settings=None):
        """Two decode steps after a 3-token prefill, the cache generation makes with `settings` (else a plain one)."""
        if settings is None:
            cache, attention = KVCache(CONFIG, batch, 8, dtype=dtype, pad=pad), None
        else:
            cache, attention = new_cache(CONFIG, batch, 8, dtype, "cpu", pad, settings)
        with torch.inference_mode():
            model(idx[:, :3].expand(batch, 3), cache=cache)
            descriptions.append(attention)
            return [model(idx[:, i:i + 1].expand(batch, 1), cache=cache, pos=i, logits_to_keep=1)[0] for i in (3, 4)]

    decode(settings=Settings())  # the kernel's check against KVCache.attend runs once, here, not in what is counted
    assert calls(decode) == {"gpt2port::attend_one": 0, "aten::scaled_dot_product_attention": 3 * L}  # the model's
    assert calls(lambda: decode(settings=Settings())) == {"gpt2port::attend_one": 2 * L,
                                                          "aten::scaled_dot_product_attention": L}  # prefill: SDPA
    assert descriptions[-1] == "attention on gpt2port's kernel"  # what `generate -v` says
    with_kernel = decode(settings=Settings())
    torch.testing.assert_close(torch.cat(with_kernel), torch.cat(decode()), rtol=tolerance, atol=tolerance)
    for elsewhere in (lambda: decode(batch=2, settings=Settings()),
                      lambda: decode(batch=2, pad=torch.tensor([0, 1]), settings=Settings()),
                      lambda: decode(settings=Settings(attend_one=False)),  # its own switch
                      lambda: decode(settings=Settings(native=False))):
        assert calls(elsewhere)["gpt2port::attend_one"] == 0
    assert descriptions[-1] == "attention on SDPA (switched off)"
    torch.testing.assert_close(torch.cat(with_kernel), torch.cat(decode(settings=Settings(attend_one=False))),
                               rtol=tolerance, atol=tolerance)


@needs_kernel
def test_training_and_autograd_keep_pytorchs_attention():
    torch.manual_seed(0)
    model = accelerate(GPT(CONFIG), Settings())
    cache, _ = new_cache(CONFIG, 1, 8, torch.float32, "cpu", None, Settings())
    model(torch.tensor([[1, 2]]), cache=cache)  # in training, with autograd
    assert calls(lambda: model(torch.tensor([[3]]), cache=cache, pos=2))["gpt2port::attend_one"] == 0
    model.eval()
    assert calls(lambda: model(torch.tensor([[4]]), cache=cache, pos=3))["gpt2port::attend_one"] == 0  # autograd on
    with torch.inference_mode():
        assert calls(lambda: model(torch.tensor([[4]]), cache=cache, pos=3))["gpt2port::attend_one"] == CONFIG.n_layer


@needs_kernel
def test_the_kernel_reads_the_row_the_qkv_layer_wrote_without_copying_it():
    """q, k, v as the model makes them (views of one qkv row) go to the kernel as that row, no torch.cat; q, k, v
    that lie elsewhere are joined first; both give what KVCache.attend gives."""
    torch.manual_seed(0)
    H, D = CONFIG.n_head, CONFIG.head_dim
    row = torch.randn(1, 1, 3 * H * D)
    views = row.view(1, 1, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)  # as CausalSelfAttention splits it
    apart = [t.clone() for t in views]  # the same numbers, in three tensors of their own
    results = []
    with torch.inference_mode():
        for q, k, v in (views, apart):
            cache, _ = new_cache(CONFIG, 1, 8, torch.float32, "cpu", None, Settings())
            plain = KVCache(CONFIG, 1, 8, dtype=torch.float32)
            with torch.profiler.profile() as prof:
                got = cache.attend(0, q, k, v, 3, None)
            results.append(sum(e.name == "aten::cat" for e in prof.events()))
            torch.testing.assert_close(got, plain.attend(0, q, k, v, 3, None), rtol=1e-5, atol=1e-5)
            assert torch.equal(cache.k, plain.k) and torch.equal(cache.v, plain.v)
    assert results == [0, 1]
