"""The decode step: the model's own forward for one new token per row, called as it is, or on a GPU recorded as a
CUDA graph and replayed per token. Nothing here computes any of the model: a graph is the forward, recorded.

On the CPU a step is the forward called from Python, on the kernels gpt2port.fast swapped in (layers and the cache's
attention). It was traced with TorchScript's tracer and replayed without that Python; TorchScript is deprecated, and
PyTorch's private graph passes it needed are no supported API, so nothing here uses either (docs/performance.md
gives what that cost).

Why a graph on a GPU: a step is a few hundred small kernels each launched from Python, bound by launches rather than
by memory; a graph records them once and replays them with one launch. What it records is the forward's static-shape
form: GPT.forward with the position a (1,) tensor (KVCache.attend writes at it by index_copy_ and reads over every
slot of the cache, masked). Before the graph is trusted, its first replay is checked against the forward called as
it is, at the same position; where they differ, or the forward cannot be recorded, decoding goes on without it and
says why (`generate -v`).
"""

from __future__ import annotations

import torch

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


def decode_step(model, cache: KVCache, settings: Settings, attention: str = "") -> Forward:
    """How generation runs one token per row: the model's forward, recorded as a CUDA graph on a CUDA device when
    settings.cuda_graph, where nothing forbids it. `.description` says which (and `attention`, what the cache said)."""
    why = _why_not_captured(model, cache, settings.cuda_graph and cache.k.device.type == "cuda")
    if why is None:
        return Graphed(model, cache, attention)
    return Forward(model, cache, "the model's forward" + (f" (no CUDA graph: {why})" if why else ""), attention)


def _why_not_captured(model, cache: KVCache, asked: bool) -> str | None:
    """None where the forward may be captured, "" where no capture was asked for, else why not."""
    if not asked:
        return ""
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
