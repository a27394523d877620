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
the forward called as it is, at the same positions (a replay and a compiled step at two, so that a position or a
token read in Python and frozen shows); where they differ, or the forward cannot be captured, decoding goes on
without it and says why (`generate -v`).
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


CAPTURE_CHECKS = 2  # positions at which a captured step is checked: one that froze the position agrees at the first


class Captured(Forward):
    """The forward captured on its first call (one unpadded row on the CPU), checked against the forward as it is at
    its first CAPTURE_CHECKS steps, then run captured; where the capture fails or disagrees, the forward as it is."""

    def __init__(self, model, cache: KVCache, how: str, attention: str = ""):
        super().__init__(model, cache, how, attention)
        # the step's inputs, each a tensor of its own (generation's ids are a view of its tokens)
        self.ids, self.pos = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
        self.unchecked, self.declined, self.step = CAPTURE_CHECKS, False, None

    def __call__(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        if self.declined or torch.is_grad_enabled():
            return super().__call__(ids, pos)
        self.ids.copy_(ids)
        self.pos.fill_(pos)
        if not self.unchecked:
            return self.step(self.ids, self.pos)
        self.unchecked -= 1
        eager = None
        try:
            if self.step is None:
                eager = self._capture()  # the forward's own logits where capturing ran it
            # The capture checked: run as it is, then the slots it may have written put back (a wrong step may write
            # anywhere up to pos; what lies past it is written before it is read) and compared with the forward
            written = self.cache.k[..., : pos + 1, :], self.cache.v[..., : pos + 1, :]
            kept = [t.clone() for t in written]
            try:
                got = self.step(self.ids, self.pos)
            finally:
                for t, old in zip(written, kept):
                    t.copy_(old)
        except Exception as e:  # noqa: BLE001 - export, compilers and replays raise many kinds; each: decode without
            got = None
            self._decline(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        if eager is None:
            eager = super().__call__(ids, pos)
        if got is not None and not self._agrees(got, eager):
            self._forget()
            self._decline(f"its {self.kind} disagreed with it at position {pos}")
        return eager


class Replayed(Captured):
    """The forward's operator calls recorded on its first call and replayed from C++ after (gpt2port.fast.replay):
    the same kernels in the same order, one call from Python a step instead of ~250."""
    kind = "replay"

    def __init__(self, model, cache: KVCache, attention: str = ""):
        super().__init__(model, cache, "the model's forward, replayed from C++", attention)

    def _capture(self) -> torch.Tensor:
        from gpt2port.fast import replay

        eager, self.step = replay.record(
            lambda: self.model(self.ids, cache=self.cache, pos=self.pos, logits_to_keep=1)[0], (self.ids, self.pos))
        self.how = f"the model's forward, replayed from C++ (its {self.step.calls} operator calls recorded once)"
        return eager

    def _agrees(self, got: torch.Tensor, eager: torch.Tensor) -> bool:
        # the same kernels on the same numbers: equal but for a kernel that sums in another order from call to call
        # (a model's NaN or infinite logits are its own: the replay has them where the forward does)
        eager = eager.float()
        return torch.allclose(got.float(), eager, rtol=1e-5, atol=1e-5 * float(eager.abs().nan_to_num(0, 0, 0).max()),
                              equal_nan=True)

    def _forget(self) -> None:
        self.step = None

    def _decline(self, why: str) -> None:
        self.declined, self.how = True, f"the model's forward (not replayed: {why[:300]})"


class Compiled(Captured):
    """The same forward compiled ahead of time (gpt2port.fast.package) on its first call."""
    kind = "compiled forward"

    def __init__(self, model, cache: KVCache, attention: str = ""):
        super().__init__(model, cache, "the model's forward, compiled ahead of time by AOTInductor", attention)

    def _capture(self) -> None:
        from gpt2port.fast import package

        self.step = package.load(self.model, self.cache)

    def _agrees(self, got: torch.Tensor, eager: torch.Tensor) -> bool:
        # Inductor fuses and orders the arithmetic its own way: the same numbers to float rounding, which in bf16
        # is coarse, and in int4 moves an activation's 8-bit rounding by a step now and then, which the layers after
        # it spread (1-1.5% of the largest logit at 124M; a wrong position or weight moves logits by far more)
        int4 = getattr(self.model, "quantized", None) == "int4"
        tolerance = 5e-2 if int4 else 1e-3 if eager.dtype == torch.float32 else 3e-2
        return torch.allclose(got.float(), eager.float(), rtol=tolerance, atol=tolerance * float(eager.abs().max()))

    def _forget(self) -> None:
        from gpt2port.fast import package

        package.forget(self.step)

    def _decline(self, why: str) -> None:
        self.declined, self.how = True, f"the model's forward (not compiled: {why[:300]})"


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
