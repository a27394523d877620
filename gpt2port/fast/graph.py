"""The decode step: the model's own forward for one new token per row, called as it is, traced on the CPU, or on a
GPU recorded as a CUDA graph; both captures are replayed per token. Nothing here computes any of the model: a trace
and a graph are the forward, recorded.

Why a trace on the CPU: a step is ~400 small operations, called from Python through ~140 module calls, and that
Python is a visible share of a step (docs/performance.md). PyTorch's tracer (torch.jit.trace) records every
operation the forward ran, on the kernels it ran them on (the swapped layers' included), and its interpreter replays
them without the Python between them. It is the one capture that does so without compiling: torch.compile's
backends either run the captured graph from Python again or compile for minutes (docs/architecture.md). The trace
is taken where gpt2port's attention kernel serves the cache (one unpadded row); elsewhere attention over the cache
would be recorded over every slot, masked. What a trace cannot hold: Python that reads a tensor's value (an `if` on
a tensor, an `int(t)`) is frozen at the value it had while tracing; the checks below see it where the value changes
by then (as a position does), and Settings(trace=False) or GPT2PORT_TRACE=0 keeps to the forward as it is.

Why a graph on a GPU: a step is a few hundred small kernels each launched from Python, bound by launches rather than
by memory; a graph records them once and replays them with one launch.

Both replay fixed operations, so what they record is the forward's static-shape form: GPT.forward with the position
a (1,) tensor, which the cache's attention reads when it runs (gpt2port's kernel on the CPU; on a GPU, KVCache.attend
writes at it by index_copy_ and reads over every slot of the cache, masked). Before a capture is trusted, its first
replays are checked against the forward called as it is, at the same positions (a trace at two, so that a frozen
position shows); where they differ, or the forward cannot be captured, decoding goes on without it and says why
(`generate -v`).
"""

from __future__ import annotations

import warnings
import weakref

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


class _Holder(torch.nn.Module):
    """A module for the tracer whose attributes are the C++ objects the traced function uses, and nothing else."""

    def __init__(self, function, objects: list):
        super().__init__()
        self.__dict__["function"] = function  # not an attribute the tracer would look into
        for i, o in enumerate(objects):
            setattr(self, f"object{i}", o)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.function(*args)


TRACE_CHECKS = 2  # positions at which a new trace is checked: one that froze the position agrees at the first only
# Traces kept while their model lives, by what decides the operations traced (the settings, the cache's dtype, the
# C++ objects a trace holds): a later generation replays one after checking it at its first step, and traces anew
# where it disagrees (the model changed since).
_TRACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fold_shapes(trace, args: tuple) -> None:
    """The trace's arithmetic on sizes folded into numbers, in place: a step's shapes are fixed, and the tracer records
    each size the forward reads (~half of a step's operations). PyTorch's own graph passes, which are private: where
    they fail the trace stays as it was; what they leave is checked with the rest of the trace."""
    graph, inputs = (trace.forward.graph, (trace._c, *args)) if hasattr(trace, "forward") else (trace.graph, args)
    try:
        torch._C._jit_pass_complete_shape_analysis(graph, inputs, False)
        torch._C._jit_pass_peephole(graph, False)
        torch._C._jit_pass_constant_propagation(graph)
        torch._C._jit_pass_dce(graph)
    except (AttributeError, RuntimeError):
        pass


class Traced(Forward):
    """The same forward traced on its first call, replayed on the later ones (one unpadded row on the CPU)."""

    def __init__(self, model, cache: KVCache, settings: Settings, attention: str = ""):
        super().__init__(model, cache, "the model's forward, traced once and replayed", attention)
        self.pos = torch.zeros(1, dtype=torch.long)
        # The trace's inputs besides the token and position: the model's tensors and the cache's, read and written
        # where they are, not copied
        self.tensors = (*dict.fromkeys([*model.parameters(), *model.buffers()]), cache.k, cache.v)
        # Objects of PyTorch's C++ classes the forward passes to operators (fbgemm's packed int8 weights) can be no
        # input: a trace holds them
        self.objects = [v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.ScriptObject)]
        self.key = (settings, cache.k.dtype, tuple(map(id, self.objects)))
        self.trace = _TRACES.get(model, {}).get(self.key)
        self.reused = self.trace is not None
        self.unchecked = 1 if self.reused else TRACE_CHECKS
        self.declined = False

    def __call__(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        if self.declined or torch.is_grad_enabled():
            return super().__call__(ids, pos)
        self.pos.fill_(pos)
        if not self.unchecked:
            return self._replay(ids)
        # Checked: the forward as it is (the first time, the run that traced it), then the replay from the cache as
        # it was before (a wrong trace may write anywhere; what lies past `pos` is written before it is read)
        self.unchecked -= 1
        written = self.cache.k[..., : pos + 1, :], self.cache.v[..., : pos + 1, :]
        kept = [t.clone() for t in written]
        eager = self._take(ids) if self.trace is None else self._forward(ids)
        if self.declined:
            return eager if eager is not None else super().__call__(ids, pos)
        for t, old in zip(written, kept):
            t.copy_(old)
        try:
            logits = self._replay(ids)
        except RuntimeError:  # a kept trace that no longer fits the model
            logits = None
        if logits is not None and torch.equal(logits, eager):
            return logits
        for t, old in zip(written, kept):
            t.copy_(old)
        if self.reused:  # kept from an earlier generation, of a model that changed since: traced again next step
            _TRACES[self.model].pop(self.key, None)
            self.trace, self.reused, self.unchecked = None, False, TRACE_CHECKS
        else:
            self._decline(f"its trace disagreed with it at position {pos}")
        return super().__call__(ids, pos)

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, cache=self.cache, pos=self.pos, logits_to_keep=1)[0]  # what is traced, as it is

    def _replay(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.jit.optimized_execution(False):  # the operations as recorded: nothing fused or reordered
            return self.trace(ids, self.pos, *self.tensors)

    def _take(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Trace the step at self.pos and return what that run of the forward computed (None if it failed). A trace
        of a function, its tensors inputs, is made in a fifth of the time of a trace of the module tree."""
        # The traced function keeps this one, and what it holds: the model and the cache, weakly
        model, cache, ran = weakref.ref(self.model), weakref.ref(self.cache), []

        def step(ids: torch.Tensor, pos: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
            ran.append(model()(ids, cache=cache(), pos=pos, logits_to_keep=1)[0])
            return ran[-1]

        # The tracer's warnings are not for the user: that it is deprecated (it is kept as the one capture replayed
        # without Python), and one per shape the forward looks at (shapes are fixed here; values the checks see).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                self.trace = torch.jit.trace(_Holder(step, self.objects) if self.objects else step,
                                             (ids, self.pos, *self.tensors), check_trace=False)
            except (RuntimeError, TypeError, ValueError) as e:  # the forward cannot be traced: it runs as it is
                self._decline(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                return ran.pop() if ran else None
        _fold_shapes(self.trace, (ids, self.pos, *self.tensors))
        _TRACES.setdefault(self.model, {})[self.key] = self.trace
        return ran.pop()

    def _decline(self, why: str) -> None:
        if self.trace is not None:  # not kept for a later generation either
            _TRACES.get(self.model, {}).pop(self.key, None)
        self.declined, self.trace = True, None
        self.how = f"the model's forward (not traced: {why})"


def decode_step(model, cache: KVCache, settings: Settings, attention: str = "") -> Forward:
    """How generation runs one token per row: the model's forward, traced on the CPU for one unpadded row when
    settings.trace, recorded as a CUDA graph on a CUDA device when settings.cuda_graph, where nothing forbids it.
    `.description` says which (and `attention`, what the cache said)."""
    on_cuda = cache.k.device.type == "cuda"
    why = _why_not_captured(model, cache, settings.cuda_graph if on_cuda else settings.trace)
    if why is None:
        return Graphed(model, cache, attention) if on_cuda else Traced(model, cache, settings, attention)
    kind = "CUDA graph" if on_cuda else "trace"
    return Forward(model, cache, "the model's forward" + (f" (no {kind}: {why})" if why else ""), attention)


def _why_not_captured(model, cache: KVCache, asked: bool) -> str | None:
    """None where the forward may be captured, "" where no capture was asked for, else why not."""
    if not asked or cache.k.device.type not in ("cpu", "cuda"):
        return ""
    if cache.k.device.type == "cpu" and not isinstance(cache, KernelCache):  # a batch, or the kernel declined
        return "attention is not on gpt2port's kernel"
    if not hasattr(torch.jit, "trace") and cache.k.device.type == "cpu":
        return f"this PyTorch ({torch.__version__}) has no tracer"
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
