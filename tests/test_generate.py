"""Generation: KV-cached decoding against full recompute, greedy parity with transformers' generate, sampling, the
sliding context window, and the `gpt2port generate` command."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from scripts import hf_fixtures
from gpt2port import GPT, KVCache, load_tokenizer
from gpt2port.cli import main
from gpt2port import convert
from gpt2port.errors import GPT2PortError
from gpt2port.generate import NonFiniteLogits, _left_pad, generate, sample, stream

pytestmark = pytest.mark.usefixtures("one_thread")
N_NEW = 50
TINY_PROMPTS = [[464, 3290], [15496, 995, 11, 314, 1101, 257, 3290, 13], [50256], list(range(1000, 1013))]


@pytest.fixture(scope="module")
def lively(tmp_path_factory):
    """(HF model, our GPT, checkpoint dir) of a tiny GPT-2 (64 positions) whose matrices are scaled up 10x: the
    default init makes a tiny model repeat one token forever, which would let a broken cache or position go unseen."""
    hf = hf_fixtures.make_hf_model(hf_fixtures.hf_config(hf_fixtures.TINY), seed=3)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.mul_(10.0)
    hf.generation_config.eos_token_id = None  # compare full runs; stopping is tested on its own
    root = tmp_path_factory.mktemp("lively")
    hf_fixtures.write_repo(copy.deepcopy(hf), root / "hf", "hub")
    convert(root / "hf", root / "ckpt")
    return hf, GPT.from_pretrained(root / "ckpt"), root / "ckpt"


def hf_greedy(hf, prompts, n, eos=None):
    """transformers' greedy generate on a left-padded batch (its attention_mask sets positions and hides padding)."""
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                          eos_token_id=eos)
    return [row[L:].tolist() for row in out]


def full_recompute_greedy(model, prompt, n, window):
    """The textbook loop: re-run the newest `window` tokens every step. The reference for the sliding window."""
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq[-window:]]))[0][0, -1].argmax()))
    return seq[len(prompt):]


# --- greedy parity with transformers ---------------------------------------------------------------------------------

def test_greedy_equals_hf_generate_each_prompt(lively):
    hf, ours, _ = lively
    for prompt in TINY_PROMPTS:
        got = generate(ours, [prompt], N_NEW, temperature=0, stop_token=None)[0]
        assert got == hf_greedy(hf, [prompt], N_NEW)[0], prompt
        assert len(set(got)) >= 5  # the model really varies its output, so the comparison means something


def test_greedy_equals_hf_generate_ragged_and_equal_batches(lively):
    hf, ours, _ = lively
    assert generate(ours, TINY_PROMPTS, N_NEW, temperature=0, stop_token=None) == hf_greedy(hf, TINY_PROMPTS, N_NEW)
    equal = [[464, 3290, 373], [40, 588, 257], [7, 8, 9]]
    batch = generate(ours, torch.tensor(equal), N_NEW, temperature=0, stop_token=None)
    assert batch == hf_greedy(hf, equal, N_NEW)
    # And a row in a batch gets what it gets alone.
    assert batch[1] == generate(ours, [equal[1]], N_NEW, temperature=0, stop_token=None)[0]


def test_stop_token_ends_each_row_like_hf(lively):
    hf, ours, _ = lively
    prompts = TINY_PROMPTS[:2]
    free = generate(ours, prompts, 20, temperature=0, stop_token=None)
    stop = free[0][6]  # a token row 0 produces: it must stop there, row 1 only if it meets it too
    got = generate(ours, prompts, 20, temperature=0, stop_token=stop)
    for row, ref in zip(got, hf_greedy(hf, prompts, 20, eos=stop)):
        assert row == (ref[:ref.index(stop)] if stop in ref else ref)
    assert got[0] == free[0][:free[0].index(stop)]
    assert list(stream(ours, prompts[0], 20, temperature=0, stop_token=stop)) == got[0]


@pytest.mark.heavy  # a second size of a check the default run makes on the tiny model
@pytest.mark.fullsize
def test_greedy_equals_hf_generate_124m(gpt2_hf_repo, gpt2_ckpt):
    """Tokens from single prompts and a ragged batch, and the logits of every step (a random 124M model settles
    into repeating a token or two, so the logits carry most of the evidence)."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(gpt2_hf_repo).eval()
    hf.generation_config.eos_token_id = None
    ours = GPT.from_pretrained(gpt2_ckpt)
    prompts = [[464, 3290], [15496, 995, 11, 314, 1101, 257, 3290, 13, 50256, 40], list(range(3000, 3017))]
    assert generate(ours, prompts[:1], N_NEW, temperature=0, stop_token=None) == hf_greedy(hf, prompts[:1], N_NEW)
    got = generate(ours, prompts, N_NEW, temperature=0, stop_token=None)
    L = max(len(p) for p in prompts)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([[0] * (L - len(p)) + p for p in prompts]),
                          attention_mask=torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts]),
                          max_new_tokens=N_NEW, do_sample=False, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    assert got == ref.sequences[:, L:].tolist()
    tokens, pad = _left_pad(prompts, "cpu")
    cache = KVCache(ours.config, len(prompts), L + N_NEW, torch.float32, "cpu", pad)
    with torch.inference_mode():
        logits = ours(tokens, cache=cache, logits_to_keep=1)[0][:, -1]
        for step, hf_logits in enumerate(ref.logits):
            torch.testing.assert_close(logits, hf_logits, rtol=1e-4, atol=1e-4 * float(hf_logits.abs().max()))
            logits = ours(ref.sequences[:, L + step : L + step + 1], cache=cache, pos=L + step,
                          logits_to_keep=1)[0][:, -1]


def test_onednn_linear_computes_what_f_linear_does(lively, monkeypatch):
    """Inference on CPU runs the fast Linear layers on oneDNN; the numbers and tokens are F.linear's, and training
    (autograd on) still goes through F.linear."""
    from gpt2port.fast import Settings, accelerate, restore
    from gpt2port.fast.kernels import onednn_works

    hf, model, _ = lively
    if not onednn_works():
        pytest.skip("this PyTorch build has no oneDNN linear kernel")
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a))
    idx = torch.tensor([TINY_PROMPTS[3], TINY_PROMPTS[3][::-1]])
    accelerate(model, Settings())
    try:
        with torch.inference_mode():
            fast, _ = model(idx)
            assert len(calls) == 2 * 4 + 1  # every Linear: 2 blocks x (qkv, proj, fc, proj) + the head
            accelerate(model, Settings(onednn=False))
            torch.testing.assert_close(fast, model(idx)[0], rtol=1e-5, atol=1e-5 * float(fast.abs().max()))
            accelerate(model, Settings())
        assert generate(model, TINY_PROMPTS, N_NEW, temperature=0, stop_token=None) == \
            hf_greedy(hf, TINY_PROMPTS, N_NEW)
        calls.clear()
        _, loss = model(idx[:, :-1], targets=idx[:, 1:])
        loss.backward()
        assert not calls and model.tok_emb.weight.grad is not None
    finally:
        restore(model)
        model.zero_grad(set_to_none=True)


# --- the KV cache -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.03), (torch.float16, 0.005)])
def test_cached_logits_equal_full_recompute_every_step(lively, dtype, tol):
    """A ragged batch (so padding, per-row positions and masks are exercised) decoded step by step through the cache;
    at every step each row's logits equal a cache-free forward over that row alone."""
    _, model, ckpt = lively
    if dtype != torch.float32:
        model = GPT.from_pretrained(ckpt, dtype=dtype)
    prompts = [TINY_PROMPTS[0], TINY_PROMPTS[1], TINY_PROMPTS[2]]
    tokens, pad = _left_pad(prompts, "cpu")
    rows = [list(p) for p in prompts]
    cache = KVCache(model.config, len(rows), 40, dtype, "cpu", pad)
    worst = 0.0
    with torch.inference_mode():
        logits = model(tokens, cache=cache, logits_to_keep=1)[0][:, -1]
        for step in range(30):
            for i, row in enumerate(rows):
                ref = model(torch.tensor([row]))[0][0, -1].float()
                worst = max(worst, float((logits[i].float() - ref).abs().max() / ref.abs().max()))
            nxt = logits.argmax(-1)
            for row, t in zip(rows, nxt.tolist()):
                row.append(t)
            logits = model(nxt.view(-1, 1), cache=cache, pos=tokens.size(1) + step, logits_to_keep=1)[0][:, -1]
    assert worst < tol, f"largest difference, relative to the largest logit: {worst:.2e}"


def test_stream_prefills_once_then_one_token_per_step(lively):
    _, model, _ = lively
    seen = []
    hook = model.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(args[0].shape[1]),
                                           with_kwargs=True)
    try:
        gen = stream(model, TINY_PROMPTS[1], 5, temperature=0, stop_token=None)
        next(gen)
        assert seen == [8]  # the first token comes from the prefill alone: streaming, not batch-then-print
        list(gen)
        assert seen == [8, 1, 1, 1, 1]
    finally:
        hook.remove()


# --- context longer than n_positions ----------------------------------------------------------------------------------

def test_keep_full_window_equals_recomputing_the_last_n_positions(lively):
    _, model, _ = lively
    n = model.config.n_positions
    prompt = list(range(2000, 2050))  # 50 + 40 new > 64 positions
    got = generate(model, [prompt], 40, temperature=0, stop_token=None, keep=n)[0]
    assert got == full_recompute_greedy(model, prompt, 40, n)


def test_default_window_slides_to_half_the_context(lively):
    _, model, _ = lively
    n, keep = model.config.n_positions, model.config.n_positions // 2
    prompt = list(range(2000, 2090))  # longer than the context: the newest n tokens are used
    seq, start, ref = list(prompt), len(prompt) - n, []
    with torch.inference_mode():
        for _ in range(60):
            if len(seq) - start > n:  # full: the window restarts from the newest `keep` tokens
                start = len(seq) - keep
            ref.append(int(model(torch.tensor([seq[start:]]))[0][0, -1].argmax()))
            seq.append(ref[-1])
    assert generate(model, [prompt], 60, temperature=0, stop_token=None) == [ref]
    # A batch where one row overflows and one does not: each row as alone.
    batch = generate(model, [prompt, [5, 6, 7]], 60, temperature=0, stop_token=None)
    assert batch == [ref, generate(model, [[5, 6, 7]], 60, temperature=0, stop_token=None)[0]]


# --- sampling ---------------------------------------------------------------------------------------------------------

def test_same_seed_same_tokens_and_global_rng_untouched(lively):
    _, model, _ = lively
    state = torch.get_rng_state()
    a = generate(model, [TINY_PROMPTS[0]], 30, temperature=1.0, seed=7, stop_token=None)
    b = generate(model, [TINY_PROMPTS[0]], 30, temperature=1.0, seed=7, stop_token=None)
    c = generate(model, [TINY_PROMPTS[0]], 30, temperature=1.0, seed=8, stop_token=None)
    assert a == b and a != c
    assert torch.equal(torch.get_rng_state(), state)
    assert list(stream(model, TINY_PROMPTS[0], 30, temperature=1.0, seed=7, stop_token=None)) == a[0]


def test_degenerate_sampling_settings_are_greedy(lively):
    _, model, _ = lively
    greedy = generate(model, TINY_PROMPTS, 30, temperature=0, stop_token=None)
    for kwargs in (dict(top_k=1), dict(top_p=1e-6), dict(temperature=0.0, top_k=40, top_p=0.9)):
        kwargs.setdefault("temperature", 1.5)
        assert generate(model, TINY_PROMPTS, 30, seed=0, stop_token=None, **kwargs) == greedy, kwargs


def test_sample_follows_the_filtered_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(20000, 1)
    g = torch.Generator().manual_seed(0)

    def freq(**kw):
        return torch.bincount(sample(logits, generator=g, **kw), minlength=4).float() / logits.size(0)

    torch.testing.assert_close(freq(), probs, atol=0.015, rtol=0)
    torch.testing.assert_close(freq(top_k=2), torch.tensor([0.625, 0.375, 0, 0]), atol=0.015, rtol=0)
    torch.testing.assert_close(freq(top_k=10**6), probs, atol=0.015, rtol=0)  # k beyond the vocab: clamped
    # top_p=0.7: 0.5 alone falls short, 0.5+0.3 reaches it; the rest are dropped.
    torch.testing.assert_close(freq(top_p=0.7), torch.tensor([0.625, 0.375, 0, 0]), atol=0.015, rtol=0)
    # temperature 2 flattens: p ** (1/2), renormalised.
    flat = probs.sqrt() / probs.sqrt().sum()
    torch.testing.assert_close(freq(temperature=2.0), flat, atol=0.015, rtol=0)
    assert torch.equal(sample(logits[:3], temperature=0), torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_takes_the_first_largest_logit_in_every_dtype(dtype):
    """Greedy picks as argmax over the logits' own dtype does (on the CPU it widens them first: the same numbers),
    the first of equal largest ones included, and -inf for a token ruled out. A row of -inf, an inf or a NaN leaves
    nothing to choose: refused (NaN weights, an fp16 overflow), never a token picked from garbage."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 50257, generator=g) * 4).to(dtype)
    logits[1, [7, 900, 40000]] = 30.0  # ties for the largest: the first counts
    logits[2, [3, 50000]] = logits[2].max()  # the row's largest copied to two more places: a tie of three
    logits[3, :100] = float("-inf")
    got = sample(logits, temperature=0)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert got[1].item() == 7
    assert (sample(logits, temperature=1.0, generator=g)[3] >= 100).item()  # a ruled-out token is never drawn
    for k, bad in enumerate([float("-inf"), float("inf"), float("nan")]):
        broken = logits.clone()
        broken[k + 1] = bad if k == 0 else broken[k + 1]
        broken[k + 1, 12345] = bad
        for temperature in (0, 1.0):
            with pytest.raises(NonFiniteLogits, match="NaN or Inf"):
                sample(broken, temperature=temperature, generator=g)


def test_bad_arguments_are_one_line_errors(lively):
    _, model, _ = lively
    for kwargs, word in [(dict(temperature=-1), "temperature"), (dict(top_p=1.5), "top_p"),
                         (dict(top_k=-2), "top_k"), (dict(keep=0), "keep")]:
        with pytest.raises(GPT2PortError, match=word):
            generate(model, [[1, 2]], 3, **kwargs)
    with pytest.raises(GPT2PortError, match="50257"):
        generate(model, [[1, 50257]], 3)
    assert generate(model, [[1, 2]], 0) == [[]]
    # An empty prompt starts from <|endoftext|>, as GPT-2's documents do.
    assert generate(model, [[]], 5, temperature=0) == generate(model, [[50256]], 5, temperature=0)
    with pytest.raises(GPT2PortError, match="empty prompt"):
        generate(model, [[]], 5, stop_token=None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_matches_cpu(lively, dtype):
    _, cpu_model, ckpt = lively
    model = GPT.from_pretrained(ckpt, dtype=dtype, device="cuda")
    got = generate(model, TINY_PROMPTS, 20, temperature=0, stop_token=None)
    ref = generate(cpu_model, TINY_PROMPTS, 20, temperature=0, stop_token=None)
    if dtype == torch.float32:
        assert got == ref
    else:  # half precision may flip a near-tie; the first tokens agree
        assert [r[:3] for r in got] == [r[:3] for r in ref]
    a = generate(model, TINY_PROMPTS, 20, seed=3, stop_token=None)
    assert a == generate(model, TINY_PROMPTS, 20, seed=3, stop_token=None)


# --- the command line -------------------------------------------------------------------------------------------------

def run_cli(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main.main(args=["generate", *map(str, args)], prog_name="gpt2port")
    return exit_info.value.code or 0, capsys.readouterr()


def test_cli_streams_greedy_text_and_reports_prefill_and_decode_apart(lively, capsys, monkeypatch):
    _, model, ckpt = lively
    tok = load_tokenizer(ckpt)
    prompt = "The dog ran"
    expected = generate(model, [tok.encode(prompt)], 12, temperature=0)[0]

    import gpt2port.generate as gen

    pieces, real_stream = [], gen.stream

    def spy(*args, **kwargs):  # records what was printed each time the CLI asks for the next token
        for token in real_stream(*args, **kwargs):
            yield token
            pieces.append(capsys.readouterr().out)

    monkeypatch.setattr(gen, "stream", spy)
    # --device cpu: the default is CUDA where there is one, and the expected tokens were computed on the CPU
    code, out = run_cli(capsys, ckpt, prompt, "--max-new-tokens", 12, "--temperature", 0, "--device", "cpu")
    assert code == 0
    text = "".join(pieces) + out.out
    assert text == prompt + tok.decode(expected) + "\n"
    assert pieces[0].startswith(prompt) and sum(bool(p) for p in pieces) >= len(expected) // 2
    # The first token comes from the prompt's forward pass (and one-time warm-up): timed as prefill, not decode.
    n_prompt = len(tok.encode(prompt))
    match = re.search(rf"^prefill {n_prompt} tokens in ([\d.]+) s; then {len(expected) - 1} tokens in ([\d.]+) s: "
                      rf"([\d.]+) tokens/s \(fp32, cpu, \d+ threads?\)$", out.err, re.M)
    assert match, out.err
    assert float(match.group(3)) > 0
    assert "bandwidth floor" not in out.err  # that needs --verbose


def test_cli_verbose_says_how_close_decoding_came_to_the_bandwidth_floor(lively, capsys):
    _, _, ckpt = lively
    code, out = run_cli(capsys, ckpt, "The dog", "-n", 6, "--temperature", 0, "--device", "cpu", "--verbose")
    assert code == 0, out.err
    match = re.search(r"^decode at (\d+)% of the memory-bandwidth floor \(([\d.]+) tokens/s: (\d+) MB of weights per "
                      r"token, ([\d.]+) GB/s measured now\)$", out.err, re.M)
    assert match, out.err
    assert float(match.group(2)) > 0 and float(match.group(4)) > 0
    # one row on gpt2port's attention kernel: the forward replayed from C++ (tests/fast/test_replay.py)
    assert re.search(r"^decode steps ran on the model's forward(, replayed from C\+\+ \(its \d+ operator calls "
                     r"recorded once\); attention on gpt2port's kernel|; attention on SDPA \(.+\))$",
                     out.err, re.M), out.err
    assert re.search(r"^one-row products on (gpt2port's one-row kernel|oneDNN|F.linear), several rows on "
                     r"(oneDNN|F.linear)$", out.err, re.M), out.err


def test_cli_reads_stdin_and_makes_reproducible_samples(lively, capsys, monkeypatch):
    _, _, ckpt = lively
    import io

    args = (ckpt, "-", "-n", 8, "--seed", 5, "--num-samples", 2, "--top-k", 20, "--top-p", 0.95)
    monkeypatch.setattr("sys.stdin", io.StringIO("Once upon a time"))
    code, first = run_cli(capsys, *args)
    monkeypatch.setattr("sys.stdin", io.StringIO("Once upon a time"))
    _, second = run_cli(capsys, *args)
    assert code == 0 and first.out == second.out
    samples = first.out.split("-" * 40 + "\n")
    assert len(samples) == 2 and all(s.startswith("Once upon a time") for s in samples)
    assert samples[0] != samples[1]  # sample i uses seed + i
    # each sample prefills the prompt and then decodes its other 7 tokens: the report says so
    assert re.search(r"^prefill 4 tokens x 2 samples in [\d.]+ s; then 14 tokens in ", first.err, re.M), first.err


def test_cli_errors_are_one_line(tmp_path, lively, capsys):
    _, _, ckpt = lively
    code, out = run_cli(capsys, tmp_path / "nope", "hi")
    assert code == 1 and out.err.startswith("error: ") and "nope" in out.err and out.err.count("\n") == 1
    code, out = run_cli(capsys, ckpt, "hi", "--temperature", -1)
    assert code == 2 and "temperature" in out.err
