"""A forward's operator calls, recorded as it runs and replayed from C++ (replay.cpp): one call from Python a step.

`record(run, inputs)` runs `run()` (the model's forward, as it is) under a dispatch mode that notes every operator it
calls, with the arguments it called it with and what each returned. The step's `inputs` (token ids, the position as
a tensor, the cache's keys and values) are given anew to each replay; every other tensor the forward read but did
not make (the weights) is a constant of the program, held by reference; whatever Python read of a tensor's value (a
check of the token ids) is not replayed, and neither are the calls only such reads needed. Nothing here knows a
model: it is the calls the forward made, in its order, on the kernels it chose (gpt2port.fast's swapped layers
included).

What a replay cannot reproduce is what the forward decided in Python from a value: a branch on a token, a position
read as a number. gpt2port.fast.graph.Replayed checks the replay against the forward itself at another position and
token before trusting it. An argument of a kind the program cannot hold (an opaque object, such as int8's packed
weights) raises Unreplayable, with what it was.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Unreplayable(Exception):
    """The forward made a call the program cannot hold (the message says which)."""


class Program:
    """A recorded forward, made into a program of replay.cpp's: called with the step's input tensors, it returns what
    the forward returned (a new tensor each call). Freed with this object."""

    def __init__(self, text: str, constants: list[torch.Tensor], calls: int):
        from gpt2port.fast import native

        missing = native.kernels().binding_why_not
        if missing is not None:
            raise Unreplayable(f"gpt2port's C++ operators are not built: {missing}")
        self.id = torch.ops.gpt2port.replay_make(text, constants)
        self.calls = calls  # how many calls were recorded (before the ones only Python's reads needed were dropped)
        self._free = weakref.finalize(self, torch.ops.gpt2port.replay_free, self.id)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        return torch.ops.gpt2port.replay_run(self.id, list(inputs))


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # The mode's own opt-out of wrapping __torch_dispatch__ in torch._dynamo.disable (nothing here is compiled):
        # that wrapper imports Dynamo, sympy and ~800 modules, ~60 MB of a process whose peak is ~400 MB
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out


def record(run: Callable[[], torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, Program]:
    """(what run() returned, the program that replays it given tensors like `inputs`). Unreplayable where a call
    cannot be held."""
    recorder = _Recorder()
    with recorder:
        result = run()
    if not isinstance(result, torch.Tensor):
        raise Unreplayable(f"the forward returned a {type(result).__name__}, not a tensor")
    text, constants = _program(recorder.calls, inputs, result)
    return result, Program(text, constants, len(recorder.calls))


def _program(calls: list[tuple], inputs: tuple[torch.Tensor, ...], result: torch.Tensor) -> tuple[str, list]:
    """replay.cpp's text for the calls (see there), and its constants."""
    slots: dict[int, int] = {id(t): i for i, t in enumerate(inputs)}
    # The constants: every tensor a call reads that neither the inputs nor an earlier call gave it. Numbered after
    # the inputs, before the results; every tensor a slot is named after is kept alive until the text is made (an
    # object's id is not reused while it lives).
    constants, made, keep = [], set(slots), []
    for _func, args, kwargs, out in calls:
        for t in _flat([*args, *kwargs.values()]):
            if isinstance(t, torch.Tensor) and id(t) not in made:
                made.add(id(t))
                slots[id(t)] = len(inputs) + len(constants)
                constants.append(t)
        made.update(id(o) for o in _flat(out) if isinstance(o, torch.Tensor))
    lines, count = [], len(inputs) + len(constants)
    for func, args, kwargs, out in calls:
        where = func.name()
        tokens = [where, *(_token(a, slots, where) for a in args),
                  *(f"k{k}={_token(v, slots, where)}" for k, v in kwargs.items())]
        results = []
        for o in _flat(out):
            if isinstance(o, torch.Tensor):  # a new slot, even for an in-place call's own argument: the same tensor
                slots[id(o)], count = count, count + 1
                keep.append(o)
                results.append(f"o{slots[id(o)]}")
            else:
                results.append("_")
        lines.append(" ".join([*tokens, "->", *results]))
    if not any(result is o for o in keep):
        raise Unreplayable("the forward's result is not a tensor any of its calls made")
    return "\n".join([f"{count} {slots[id(result)]} {len(inputs)}", *lines]), constants


def _flat(x) -> list:
    """x, or the items of a (nested) list or tuple of them."""
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flat(item)]
    return [x]


DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16", torch.bfloat16: "bfloat16",
          torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
          torch.bool: "bool"}
FORMATS = {torch.contiguous_format: "contiguous_format", torch.preserve_format: "preserve_format"}


def _token(a, slots: dict[int, int], where: str) -> str:
    """One argument as replay.cpp reads it."""
    if isinstance(a, torch.Tensor):
        return f"t{slots[id(a)]}"
    if a is None:
        return "n"
    if isinstance(a, bool):
        return f"b{int(a)}"
    if isinstance(a, int):
        return f"i{a}"
    if isinstance(a, float):
        return f"f{a!r}"
    if isinstance(a, (list, tuple)):
        if all(isinstance(x, int) and not isinstance(x, bool) for x in a):
            return "l" + ",".join(str(x) for x in a)
        if a and all(x is None or isinstance(x, torch.Tensor) for x in a):
            return "T" + ",".join("n" if x is None else str(slots[id(x)]) for x in a)
    if isinstance(a, torch.dtype) and a in DTYPES:
        return f"d{DTYPES[a]}"
    if isinstance(a, torch.device):
        return f"D{a}"
    if a is torch.strided:
        return "ystrided"
    if isinstance(a, torch.memory_format) and a in FORMATS:
        return f"m{FORMATS[a]}"
    if isinstance(a, str) and a and not any(c.isspace() for c in a):
        return f"s{a}"
    raise Unreplayable(f"{where} was called with {type(a).__name__} {a!r:.60}, which a program cannot hold")
