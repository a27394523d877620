"""The proof every load ends with: the loaded class against an independent float64 GPT-2 over the source's own
weights (verify's reference), on one short input, stage by stage (verify's localization, teacher-forced), so that a
class that does not compute GPT-2 is refused naming the first stage that differs and the known mistake that
explains it. What the load itself changed (biases dropped, the exact GELU noted) is put into the reference, so the
proof says that the class computes exactly that; the cost of each change is measured apart."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
from torch import nn

from gpt2port.config import GPTConfig
from gpt2port.dtypes import DTYPE_LABELS
from gpt2port.errors import GPT2PortError
from gpt2port.userclass.layout import UserLayout
from gpt2port.userclass.observe import evaluating, probe_ids
from gpt2port.userclass.roles import context
from gpt2port.userclass.stages import ModelStages
from gpt2port.verification.localize import Localizer
from gpt2port.verification.metrics import max_errors
from gpt2port.verification.reference import Float64GPT2
from gpt2port.verification.reference_canonical import (
    CanonicalFiles,
    checkpoint_files,
    hf_key,
    is_gpt2port_checkpoint,
)
from gpt2port.verification.tolerances import TOLERANCES

TOKENS = 16


def reference(path: Path, config: GPTConfig, load_all: Callable[[], dict] | None = None,
              zeroed: set[str] = frozenset(), erf: bool = False) -> Float64GPT2:
    """verify's float64 GPT-2 over the source at `path` (an HF or TensorFlow release read with verify's own reader,
    a gpt2port checkpoint through its memory map, or else every canonical tensor, from load_all()), with the
    canonical tensors in `zeroed` set to zero and, when `erf`, the exact GELU."""
    if is_gpt2port_checkpoint(path):
        files = checkpoint_files(path)
    else:
        try:
            files = Float64GPT2(path).files
        except GPT2PortError:
            if load_all is None:
                raise
            files = CanonicalFiles(load_all(), config.to_hf_config(), path)
    if zeroed:
        files = _Zeroed(files, zeroed)
    ref = Float64GPT2(path, files=files)
    if erf:
        ref.config = dataclasses.replace(ref.config, activation="gelu")
    return ref


class _Zeroed:
    """A reference's files with some canonical tensors read as zeros (GPT-2 without the biases a class dropped)."""

    def __init__(self, files, canonical: set[str]):
        self.inner, self.zero = files, {hf_key(n) for n in canonical}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, key):
        t = self.inner.get(key)
        return torch.zeros_like(t) if key in self.zero else t

    def get64(self, key):
        t = self.inner.get64(key)
        return torch.zeros_like(t) if key in self.zero else t


@torch.no_grad()
def prove(model: nn.Module, lay: UserLayout, ref: Float64GPT2) -> dict:
    """The class's logits against `ref` on TOKENS random ids: {"rel", "tokens", "tolerance", "passed",
    "first_divergence"}. Where they differ, every stage is run on the reference's own input for that stage
    (teacher-forced, as verify localizes) and the first that differs is named, with the known mistake that
    explains it where one does."""
    T = min(TOKENS, context(model, lay))
    ids = probe_ids(model, lay.config.vocab_size, T, seed=3)
    stages = ModelStages(model, lay)
    tol = TOLERANCES.get(DTYPE_LABELS.get(stages.dtype, "fp32"), TOLERANCES["bf16"])
    with torch.random.fork_rng(devices=[]), evaluating(model):
        ours = stages.logits(ids).float().cpu()
    rel = max_errors([(ours, ref.forward([ids.cpu()])[0])])[1]
    out = {"rel": rel, "tokens": T, "tolerance": tol.logits_rel, "passed": rel <= tol.logits_rel,
           "first_divergence": None}
    if not out["passed"]:
        out["first_divergence"] = _localize(stages, ids, ref, tol.local_rel) or \
            f"logits differ (rel {rel:.2e} > {tol.logits_rel:.2g})"
    return out


def _localize(stages: ModelStages, ids: torch.Tensor, ref: Float64GPT2, tol: float) -> str | None:
    """verify's localization on one input: the first stage that differs, and its diagnosis."""
    stream: list[torch.Tensor] = []
    try:
        with torch.random.fork_rng(devices=[]), evaluating(stages.model):
            stages.logits(ids, stream.append)
            local = Localizer(stages, [SimpleNamespace(ids=ids)], [stream], tol, ref)
            local.head(ref.forward([ids.cpu()], observe=local.observe))
        return local.result()["first_divergence"]
    except GPT2PortError:  # a stage computed inline, with no module to read it from: the whole only
        return None


def against_gpt2(model: nn.Module, lay: UserLayout, ref: Float64GPT2) -> float:
    """The class's end-to-end difference from `ref` on the proof's input (logits only)."""
    T = min(TOKENS, context(model, lay))
    ids = probe_ids(model, lay.config.vocab_size, T, seed=3)
    with torch.no_grad(), torch.random.fork_rng(devices=[]), evaluating(model):
        ours = ModelStages(model, lay).logits(ids).float().cpu()
        return max_errors([(ours, ref.forward([ids.cpu()])[0])])[1]
