"""A block's sub-layers seen where they meet the residual stream: the additions in its forward.

A GPT-2 block adds two things to the stream it is given: the attention's contribution, then the MLP's. Watching
every tensor operation of one call of the block (a torch function mode), the stream is the block's own input, and
each addition of a tensor of the stream's shape to it starts a branch: the first is the attention's, the second
the MLP's. A broadcast addition that follows (`x + y @ W_o + b_o` adds the bias to the sum) belongs to the branch
before it. This needs no module for attention or the MLP: it reads classes that write both inline (raw
Parameters, einsum, softmax in the block's forward) as surely as nanoGPT's, and it sees what is really added (a
branch scaled by 1/sqrt(2) before the addition shows as such). A branch whose addition is not to the stream so
followed (post-LN norms the first sum before the second addition; `torch.add(..., alpha=)`) is not found: None.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

_ADDS = {"add", "add_", "__add__", "__radd__", "__iadd__"}


class _Stop(Exception):
    """The wanted branch is whole: the rest of the block's forward is not needed."""


class _Watch(TorchFunctionMode):
    """Every tensor operation of one call of a block: the additions to its stream, branch by branch."""

    def __init__(self, x: torch.Tensor, want: int):
        super().__init__()
        self.stream, self.want = x, want
        self.branch: list[torch.Tensor] = []  # the current branch's operands
        self.count = 0  # branches started

    def _other(self, args):
        if len(args) < 2 or not all(isinstance(a, torch.Tensor) for a in args[:2]):
            return None
        a, b = args[0], args[1]
        return b if a is self.stream else a if b is self.stream else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        other = self._other(args) if getattr(func, "__name__", "") in _ADDS and "alpha" not in kwargs else None
        if other is None:
            return func(*args, **kwargs)
        if other.shape == self.stream.shape:  # a new branch
            if self.count == self.want:  # the wanted branch is whole: the stream moves on
                raise _Stop
            self.count += 1
            self.branch = [other]
        elif self.count:  # a broadcast addition to the branch just added (its bias)
            self.branch.append(other)
        else:
            return func(*args, **kwargs)
        if self.count == 1 and self.want == 2:  # the MLP is wanted: leave the attention's contribution out
            return self.stream  # (in place or not, the stream stays what it was)
        self.stream = func(*args, **kwargs)
        return self.stream

    def result(self) -> torch.Tensor | None:
        if self.count != self.want:
            return None
        total = self.branch[0]
        for b in self.branch[1:]:
            total = total + b
        return total


def branches(run: Callable[[torch.Tensor], object], x: torch.Tensor, which: int) -> torch.Tensor | None:
    """What a block adds to the stream `x` in its `which`-th residual branch (1: attention, 2: the MLP, run with
    the attention's contribution left out), or None where its forward does not add its branches to the stream.
    run(x) runs the block on x as the model does (calls.Calls.run)."""
    x = x.clone()  # the block may add in place; the caller's tensor stays as it was
    watch = _Watch(x, which)
    try:
        with watch:
            run(x)
    except _Stop:
        pass
    out = watch.result()
    if out is None or out.shape != x.shape:
        return None
    return out
