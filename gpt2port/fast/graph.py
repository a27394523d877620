"""The decode step: the model's own forward for one new token per row, called as it is, replayed from C++ or
compiled ahead of time on the CPU, or on a GPU recorded as a CUDA graph. Nothing here computes any of the model: a
replay, a compiled step and a graph are the forward, captured.

Called from Python, a step is ~140 module calls and ~250 operator calls a token on the kernels gpt2port.fast swapped
in, milliseconds of Python at 124M (docs/performance.md). By default one unpadded row on the CPU is `Replayed`: the
forward's operator calls recorded on its first step (gpt2port.fast.replay, a dispatch mode: the very operators it
called, with its arguments) and called again from C++ by replay.cpp, one call from Python a step. `Compiled`
(Settings(compile=True) or GPT2PORT_COMPILE=1) exports the same forward with torch.export and compiles it ahead of
time with AOTInductor into a package kept per machine and model shape (gpt2port.fast.package): asked for, not the
default, as the first run of a model shape compiles for tens of seconds and Inductor's import costs memory. Neither
uses TorchScript (deprecated) or private graph passes.

Why a graph on a GPU: a step is a few hundred small kernels each launched from Python, bound by launches rather than
by memory; a graph records them once and replays them with one launch.

Every capture takes the forward's static-shape form: GPT.forward with the position a (1,) tensor, which the cache's
attention reads when it runs (gpt2port's kernel on the CPU; on a GPU, KVCache.attend writes at it by index_copy_
and reads over every slot of the cache, masked). Before a capture is trusted, its first steps are checked against
the forward called as it is (a compiled step at its first two positions, a replay on a scratch cache at another
position and token, so that a position or a token read in Python and frozen shows); where they differ, or the
forward cannot be captured, decoding goes on without it and says why (`generate -v`).
"""
from __future__ import annotations

import torch

from gpt2port.fast.cache import KernelCache
from gpt2port.fast.settings import Settings
from gpt2port.model import KVCache


class Forward:
    """The model's forward, one token per row per call: logits (B, 1, vocab) of the next token."""

    def __init__(self, model, cache: KVCache, how: str, attention: str = ""):
        self.model, self.cache, self.how, self.attention = model, cache, how, attention

    @property
    def description(self) -> str:
        """What `generate -v` says the steps ran on."""
        return self.how + (f"; {self.attention}" if self.attention else "")

    def __call__(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        return self.model(ids, cache=self.cache, pos=pos, logits_to_keep=1)[0]


class Graphed(Forward):
    """The same forward recorded as a CUDA graph on its first call, replayed on the later ones."""

    def __init__(self, model, cache: KVCache, attention: str = ""):
        super().__init__(model, cache, "the model's forward, recorded as a CUDA graph", attention)
        batch = cache.k.size(1)
        device = cache.k.device
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.checked = False

    def __call__(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        if self.checked and self.graph is None or torch.is_grad_enabled():
            return super().__call__(ids, pos)
        self.ids.copy_(ids)
        self.pos.fill_(pos)
        if self.graph is None:
            try:
                self._record()
            except RuntimeError as e:  # what the forward does cannot be recorded: it runs as it is
                self.checked, self.how = True, f"the model's forward (no CUDA graph: {type(e).__name__}: {e})"
                return super().__call__(ids, pos)
        self.graph.replay()
        logits = self.logits.clone()  # the next replay overwrites the graph's output; the caller may keep this
        if not self.checked:  # the forward as it is, at the same position (it writes the same slot again)
            self.checked = True
            eager = super().__call__(ids, pos)
            if not torch.allclose(logits.float(), eager.float(), rtol=1e-3, atol=1e-3 * float(eager.abs().max())):
                self.graph = None
                self.how = "the model's forward (its CUDA graph disagreed with it on the first step)"
            return eager
        return logits

    def _record(self) -> None:
        # Warm up on a side stream first: cuBLAS and the attention kernels set up their workspaces on first use,
        # which must not happen while recording. The warm-up writes slot `pos` of the cache, which the step writes
        # again.
        device = self.ids.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model(self.ids, cache=self.cache, pos=self.pos, logits_to_keep=1)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self.model(self.ids, cache=self.cache, pos=self.pos, logits_to_keep=1)[0]
        self.graph = graph


COMPILE_CHECKS = 2  # positions at which a compiled step is checked: one that froze the position agrees at the first


class Compiled(Forward):
    """The same forward compiled ahead of time (gpt2port.fast.package) on its first call (one unpadded row on the
    CPU), checked against the forward as it is at its first COMPILE_CHECKS steps, then run compiled."""

    def __init__(self, model, cache: KVCache, attention: str = ""):
        super().__init__(model, cache, "the model's forward, compiled ahead of time by AOTInductor", attention)
        # the step's inputs, each a tensor of its own (generation's ids are a view of its tokens)
        self.ids, self.pos = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
        self.unchecked, self.declined, self.step = COMPILE_CHECKS, False, None

    def __call__(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        if self.declined or torch.is_grad_enabled():
            return super().__call__(ids, pos)
        self.ids.copy_(ids)
        self.pos.fill_(pos)
        if not self.unchecked:
            return self.step(self.ids, self.pos)
        # Checked: the compiled step from the cache as it is, then the slots it may have written put back (a wrong
        # step may write anywhere up to pos; what lies past it is written before it is read) and the forward as it is
        self.unchecked -= 1
        written = self.cache.k[..., : pos + 1, :], self.cache.v[..., : pos + 1, :]
        kept = [t.clone() for t in written]
        try:
            if self.step is None:
                from gpt2port.fast import package

                self.step = package.load(self.model, self.cache)
            got = self.step(self.ids, self.pos)
        except Exception as e:  # noqa: BLE001 - export and the compiler raise many kinds; each means: decode without it
            got = None
            self._decline(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        for t, old in zip(written, kept):
            t.copy_(old)
        eager = super().__call__(ids, pos)
        # Inductor fuses and orders the arithmetic its own way: the same numbers to float rounding, which in bf16
        # is coarse, and in int4 moves an activation's 8-bit rounding by a step now and then, which the layers after
        # it spread (1-1.5% of the largest logit at 124M; a wrong position or weight moves logits by far more)
        int4 = getattr(self.model, "quantized", None) == "int4"
        tolerance = 5e-2 if int4 else 1e-3 if eager.dtype == torch.float32 else 3e-2
        if got is not None and not torch.allclose(got.float(), eager.float(), rtol=tolerance,
                                                  atol=tolerance * float(eager.abs().max())):
            from gpt2port.fast import package

            package.forget(self.step)
            self._decline(f"its compiled forward disagreed with it at position {pos}")
        return eager

    def _decline(self, why: str) -> None:
        self.declined, self.how = True, f"the model's forward (not compiled: {why[:300]})"


class Replayed(Forward):
    """The forward's operator calls recorded on its first call (gpt2port.fast.replay: the same kernels in the same
    order) and replayed from C++ after, one call from Python a step instead of ~250.

    The recording is the forward itself at the first position. Before the program is trusted it is checked on a
    scratch cache of a few slots (random keys and values, the same in two copies) at another position and another
    token, against the forward there: logits and both caches, so that a position or token the forward read into
    Python and froze, or a write to the wrong slot, shows without touching the generation's own cache (whose size
    grows with the prompt). The generation's cache is an input of every replay, not a constant of the program."""

    def __init__(self, model, cache: KVCache, attention: str = ""):
        super().__init__(model, cache, "the model's forward, replayed from C++", attention)
        self.ids, self.pos = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
        self.declined, self.program = False, None

    def __call__(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        if self.declined or torch.is_grad_enabled():
            return super().__call__(ids, pos)
        self.ids.copy_(ids)
        self.pos.fill_(pos)
        if self.program is not None:
            return self.program(self.ids, self.pos, self.cache.k, self.cache.v)
        from gpt2port.fast import replay

        try:
            step = lambda: self.model(self.ids, cache=self.cache, pos=self.pos, logits_to_keep=1)[0]  # noqa: E731
            eager, program = replay.record(step, (self.ids, self.pos, self.cache.k, self.cache.v))
            self._check(program, pos)
        except Exception as e:  # noqa: BLE001 - a recording or a replay may fail in many ways; each: decode without
            text = str(e).strip().splitlines()[0] if str(e).strip() else ""
            why = text if isinstance(e, replay.Unreplayable) else f"{type(e).__name__}: {text}"
            self.declined, self.how = True, f"the model's forward (not replayed: {why[:300]})"
            return super().__call__(ids, pos)  # the slot the recording wrote, written again the same
        self.program, self.how = program, f"the model's forward, replayed from C++ (its {program.calls} operator " \
                                          f"calls recorded once)"
        return eager

    def _check(self, program, recorded: int) -> None:
        """Raises where the program and the forward differ on a scratch cache, at a position that differs from the
        recorded one by parity and by three, and another token."""
        from gpt2port.fast.replay import Unreplayable

        at = next((p for p in range(1, min(7, self.model.config.n_positions)) if p % 2 != recorded % 2 and
                   p % 3 != recorded % 3), None)
        if at is None:
            raise Unreplayable(f"a context of {self.model.config.n_positions} positions leaves none to check it at")
        k = self.cache.k
        g = torch.Generator().manual_seed(0)
        scratch = [type(self.cache)(self.model.config, 1, at + 1, k.dtype, k.device) for _ in range(2)]
        for name in ("k", "v"):
            contents = torch.randn(getattr(scratch[0], name).shape, generator=g).to(k.dtype)
            for c in scratch:
                getattr(c, name).copy_(contents)
        self.ids.add_(1).remainder_(self.model.config.vocab_size)
        self.pos.fill_(at)
        want = self.model(self.ids, cache=scratch[0], pos=at, logits_to_keep=1)[0]  # the forward as it is
        got = program(self.ids, self.pos, scratch[1].k, scratch[1].v)
        if not (_same(got, want) and _same(scratch[1].k, scratch[0].k) and _same(scratch[1].v, scratch[0].v)):
            raise Unreplayable(f"its replay disagreed with it at position {at} (a scratch cache)")


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The same kernels on the same numbers: equal but for a kernel that sums in another order from call to call
    (a model's own NaN or infinite logits are its own: the replay has them where the forward does)."""
    want = want.float()
    return torch.allclose(got.float(), want, rtol=1e-5, atol=1e-5 * float(want.abs().nan_to_num(0, 0, 0).max()),
                          equal_nan=True)


def decode_step(model, cache: KVCache, settings: Settings, attention: str = "") -> Forward:
    """How generation runs one token per row: the model's forward, on the CPU for one unpadded row replayed from C++
    (settings.replay) or compiled (settings.compile, which takes precedence), on a CUDA device recorded as a CUDA
    graph when settings.cuda_graph, where nothing forbids it. `.description` says which (and `attention`, what the
    cache said)."""
    if cache.k.device.type == "cuda":
        kind, asked = "CUDA graph", settings.cuda_graph
    else:  # a replay, the default, serves what the attention kernel serves: where that says why not, it is enough
        kind, asked = ("compile", True) if settings.compile else \
            ("replay", settings.replay and isinstance(cache, KernelCache))
    why = _why_not_captured(model, cache, asked)
    if why is None:
        return {"CUDA graph": Graphed, "compile": Compiled, "replay": Replayed}[kind](model, cache, attention)
    return Forward(model, cache, "the model's forward" + (f" (no {kind}: {why})" if why else ""), attention)


def _why_not_captured(model, cache: KVCache, asked: bool) -> str | None:
    """None where the forward may be captured, "" where no capture was asked for, else why not."""
    if not asked or cache.k.device.type not in ("cpu", "cuda"):
        return ""
    if cache.k.device.type == "cpu" and not isinstance(cache, KernelCache):  # a batch, or the kernel declined
        return "attention is not on gpt2port's kernel"
    if cache.k.device.type == "cpu" and getattr(model, "quantized", None) == "int8":
        return "int8's one-row products take fbgemm's packed weights, which a capture cannot hold"
    if any(m.training for m in model.modules()):
        return "the model is in training mode"
    if hooked(model):
        return "it has forward hooks: a capture replays operations, never Python"
    return None


def hooked(model: torch.nn.Module) -> bool:
    """Whether any hook would run in the model's own forward."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
