"""The decode step replayed from C++ (gpt2port/fast/replay.py, replay.cpp, graph.Replayed): the forward's operator
calls recorded once and called again with new inputs. Held to the forward itself, logits and cache, bit for bit, at
trained-like scales in fp32, bf16 and int4; generation's tokens equal with replay on and off, over a context that
fills and slides; a forward that decides in Python from a value is caught by the check and declined; what a program
cannot hold says what it was; bad programs are refused in one line; a step calls nothing in Python."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from gpt2port import GPT, GPTConfig
from gpt2port.fast import OFF, Settings, accelerate, decode_step
from gpt2port.fast.cache import new_cache
from gpt2port.generate import generate
from tests.realistic import make_realistic_, realistic_checkpoint

CONFIG = GPTConfig(n_layer=3, n_head=4, n_embd=64, vocab_size=300, n_positions=24)
PROMPT = [5, 17, 250, 3, 99, 12, 7]
pytestmark = pytest.mark.usefixtures("one_thread")
REPLAYED = "the model's forward, replayed from C++ (its "


@pytest.fixture(scope="module")
def kernels(native_kernels):
    if not native_kernels.attend_one:
        pytest.skip(f"no C++ operators here (a step is replayed where they serve): {native_kernels.binding_why_not}")
    return native_kernels


def realistic(dtype=torch.float32, config: GPTConfig = CONFIG, cls=GPT) -> GPT:
    return accelerate(make_realistic_(cls(config), seed=0).eval().to(dtype), Settings())


def a_step(model: GPT, length: int = 20):
    """A step for one row (the prompt prefilled) and its cache."""
    cache, attention = new_cache(model.config, 1, length, model.pos_emb.weight.dtype, "cpu", None, Settings())
    step = decode_step(model, cache, Settings(), attention)
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT]), cache=cache, logits_to_keep=1)[0]
    return step, cache, logits


def tokens(model, n: int, settings: Settings, report: list | None = None) -> list[list[int]]:
    return generate(model, [PROMPT], n, temperature=0, stop_token=None, fast=settings, report=report)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_given", [True, False], ids=["the cache an input", "the cache a constant"])
def test_a_program_is_the_forward_bit_for_bit_logits_and_cache(kernels, dtype, cache_given):
    from gpt2port.fast import replay

    model = realistic(dtype)
    _, cache, _ = a_step(model)
    twin, _, _ = a_step(model)  # the same prompt in a second cache, stepped by the forward as it is
    twin_cache = twin.cache
    ids, pos = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    inputs = (ids, pos, cache.k, cache.v) if cache_given else (ids, pos)  # graph.Replayed gives the cache
    with torch.inference_mode():
        ids[0, 0], pos[0] = 11, len(PROMPT)
        first, program = replay.record(lambda: model(ids, cache=cache, pos=pos, logits_to_keep=1)[0], inputs)
        want = model(ids, cache=twin_cache, pos=len(PROMPT), logits_to_keep=1)[0]
        assert torch.equal(first, want)
        kept = []
        for i, token in enumerate((42, 299, 0, 7, 7, 150)):
            at = len(PROMPT) + 1 + i
            ids[0, 0], pos[0] = token, at
            got = program(*inputs)
            want = model(torch.tensor([[token]]), cache=twin_cache, pos=at, logits_to_keep=1)[0]
            assert torch.equal(got, want), (i, float((got - want).abs().max()))
            kept.append((got, got.clone()))
        assert all(torch.equal(a, b) for a, b in kept)  # each step's logits are its own: no later step wrote them
    assert torch.equal(cache.k, twin_cache.k) and torch.equal(cache.v, twin_cache.v)
    assert program.calls > 10 * CONFIG.n_layer


def test_int4_steps_replay_the_forward_bit_for_bit(kernels, tmp_path):
    from gpt2port.fast.int4 import from_pretrained, why_not

    if why_not() is not None:
        pytest.skip(f"no int4 kernel here: {why_not()}")
    ckpt = realistic_checkpoint(tmp_path, {"n_layer": 2, "n_head": 4, "n_embd": 128, "n_positions": 64}, seed=0)[1]
    model = accelerate(from_pretrained(ckpt, "int4"), Settings())
    report = []
    got = generate(model, [PROMPT], 12, temperature=0, stop_token=None, fast=Settings(), report=report)
    assert report[-1].startswith(REPLAYED), report
    assert got == generate(model, [PROMPT], 12, temperature=0, stop_token=None, fast=Settings(replay=False))


def test_generation_is_the_same_with_and_without_replay_as_the_context_fills_and_slides(kernels):
    model = realistic()
    report = []
    got = tokens(model, 40, Settings(), report)  # 7 + 40 > 24 positions: the window slides and is prefilled again
    assert report[-1].startswith(REPLAYED), report
    assert got == tokens(model, 40, Settings(replay=False)) == tokens(model, 40, OFF)


class ReadsThePosition(GPT):
    """A forward that reads its position into Python and decides with it: what a replay would freeze."""

    def forward(self, idx, targets=None, cache=None, pos=0, logits_to_keep=0):
        at = int(pos) if isinstance(pos, torch.Tensor) else pos
        logits, loss = super().forward(idx, targets, cache, pos, logits_to_keep)
        return logits + 0.5 * (at % 3), loss


class ReadsTheToken(GPT):
    """A forward that branches on its token's value."""

    def forward(self, idx, targets=None, cache=None, pos=0, logits_to_keep=0):
        logits, loss = super().forward(idx, targets, cache, pos, logits_to_keep)
        return (logits * 1.5 if int(idx[0, -1]) % 2 else logits), loss


class FreezesThePosition(GPT):
    """A forward that hands its cache the position as a number read from the tensor: a program would write every
    step's keys and values at the recorded slot."""

    def forward(self, idx, targets=None, cache=None, pos=0, logits_to_keep=0):
        return super().forward(idx, targets, cache, int(pos) if isinstance(pos, torch.Tensor) else pos, logits_to_keep)


@pytest.mark.parametrize("cls", [ReadsThePosition, ReadsTheToken, FreezesThePosition])
def test_a_forward_that_decides_from_a_value_is_caught_and_declined(kernels, cls):
    model = realistic(cls=cls)
    step, _, _ = a_step(model)
    with torch.inference_mode():
        for at, token in ((7, 11), (8, 12), (9, 13)):  # an odd token then an even one, at positions 7, 8 and 9
            step(torch.tensor([[token]]), at)
    declined = r"the model's forward \(not replayed: its replay disagreed with it at position \d \(a scratch cache\)\)"
    if cls is FreezesThePosition:  # its slot lies past the scratch cache's few: the kernel refuses it
        declined = r"the model's forward \(not replayed: ValueError: gpt2port::attend_one"
    assert re.match(declined, step.description), step.description
    # and generation gives the forward's tokens: the generation's own cache never met the unchecked program
    assert tokens(model, 12, Settings()) == tokens(model, 12, Settings(replay=False))


def test_hooks_and_training_are_not_replayed_and_say_why(kernels):
    model = realistic()
    cache, attention = new_cache(CONFIG, 1, 20, torch.float32, "cpu", None, Settings())
    hook = model.blocks[0].register_forward_hook(lambda *a: None)
    try:
        assert "(no replay: it has forward hooks" in decode_step(model, cache, Settings()).description
    finally:
        hook.remove()
    assert "(no replay: the model is in training mode)" in decode_step(model.train(), cache, Settings()).description
    # a batch: the attention kernel's reason is the one given
    report = []
    generate(model.eval(), [PROMPT, PROMPT[:3]], 3, temperature=0, fast=Settings(), report=report)
    assert report[-1].startswith("the model's forward; attention on SDPA (a batch"), report


def test_an_argument_a_program_cannot_hold_is_named(kernels):
    from gpt2port.fast import replay

    x = torch.ones(1, 2, 2, 2)
    with pytest.raises(replay.Unreplayable, match=r"aten::\w+ was called with memory_format torch.channels_last, "
                                                  r"which a program cannot hold"):
        replay.record(lambda: x.contiguous(memory_format=torch.channels_last) + 1, (x,))
    with pytest.raises(replay.Unreplayable, match="the forward returned a tuple, not a tensor"):
        replay.record(lambda: (x + 1, x), (x,))


def test_numbers_keywords_and_lists_of_tensors_replay(kernels):
    """A number where a tensor is taken (x * 0.5), keyword arguments (a dtype, a device), a list of tensors (cat) and
    of optional ones (indexing), a tuple of results (max along a dimension)."""
    from gpt2port.fast import replay

    x = torch.zeros(2, 3)

    def fn():
        y = torch.cat([x * 0.5, torch.arange(3, dtype=torch.float32, device="cpu").view(1, 3) - 2]) ** 2
        values, where = y.max(dim=0)
        return y[torch.tensor([0, 2]), :1].sum() * values + where + (y > 1).float().mean(dim=-1, keepdim=True)[0]

    with torch.inference_mode():
        first, program = replay.record(fn, (x,))
        for seed in range(3):
            x.copy_(torch.randn(2, 3, generator=torch.Generator().manual_seed(seed)))
            assert torch.equal(program(x), fn())
        assert torch.equal(program(x.clone()), fn())  # another tensor of the same shape


def test_bad_programs_and_calls_are_refused_in_one_line(kernels):
    make, run = torch.ops.gpt2port.replay_make, torch.ops.gpt2port.replay_run
    one = [torch.ones(2)]
    for text, message in [("", "an empty program"), ("1 0", "starts with '<slots> <result> <inputs>'"),
                          ("2 1 1\naten::nothing t0 -> o1", "no operator aten::nothing"),
                          ("2 1 1\naten::neg t5 -> o1", "slot 5 out of range"),
                          ("2 1 1\naten::add.Tensor t0 t0 kbeta=i1 -> o1", "has no argument beta"),
                          ("2 1 1\naten::add.Tensor t0 -> o1", "lacks other"),
                          ("2 1 1\naten::neg t0 q1 -> o1", "too many arguments"),
                          ("2 1 1\naten::neg t0 -> o9", "result slot o9 out of range"),
                          ("1 5 1", "1 slots cannot hold")]:
        with pytest.raises(ValueError, match=message):
            make(text, one)
    program = make("2 1 1\naten::neg t0 -> o1", [])
    with torch.inference_mode():
        assert torch.equal(run(program, one), -one[0])
    with pytest.raises(ValueError, match="takes 1 inputs, got 2"):
        run(program, one * 2)
    torch.ops.gpt2port.replay_free(program)
    with pytest.raises(ValueError, match=f"no program {program}"):
        run(program, one)


def test_a_program_is_freed_with_its_object(kernels):
    from gpt2port.fast import replay

    x = torch.ones(4)
    _, program = replay.record(lambda: x * 2, (x,))
    number = program.id
    del program
    with pytest.raises(ValueError, match=f"no program {number}"):
        torch.ops.gpt2port.replay_run(number, [x])


def test_a_replayed_step_runs_no_python_of_the_model(kernels):
    model = realistic()
    step, _, logits = a_step(model)
    calls = []
    with torch.inference_mode():
        for at in range(len(PROMPT), len(PROMPT) + 2):  # recorded and checked: the forward ran in Python
            step(torch.tensor([[at]]), at)
        sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_filename) if event == "call" else None)
        try:
            step(torch.tensor([[3]]), len(PROMPT) + 2)
        finally:
            sys.setprofile(None)
    assert step.description.startswith(REPLAYED), step.description
    assert not [c for c in calls if c.endswith(("model.py", "kernels.py", "cache.py"))], calls


def test_recording_imports_no_compiler(kernels):
    """The dispatch mode's own default would wrap the recorder in Dynamo's disable: ~800 modules and ~60 MB."""
    code = ("import sys, torch\n"
            "from gpt2port.fast import native, replay\n"
            "x = torch.ones(3)\n"
            "replay.record(lambda: x + 1, (x,))\n"
            "assert 'torch._dynamo' not in sys.modules and 'sympy' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
