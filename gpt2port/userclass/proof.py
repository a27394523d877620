"""The proof every load ends with: the loaded class against an independent float64 GPT-2 over the source's own weights
(verify's reference), on two sequences over the class's whole context, batched and apart, stage by stage (verify's
localization, teacher-forced), so that a class that does not compute GPT-2 is refused naming the first stage that
differs and the known mistake that explains it. What the load itself changed (biases dropped, the exact GELU noted)
is put into the reference, so the proof says that the class computes exactly that; the cost of each change is
measured apart."""

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
from gpt2port.verification.metrics import absmax, max_errors, ratio
from gpt2port.verification.reference import Float64GPT2, logits64
from gpt2port.verification.reference_canonical import (
    CanonicalFiles,
    checkpoint_files,
    hf_key,
    is_gpt2port_checkpoint,
)
from gpt2port.verification.tolerances import TOLERANCES

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


def proof_ids(model: nn.Module, vocab: int, T: int) -> tuple[torch.Tensor, int, str]:
    """(ids (2, T), L, words): two different random sequences filling the class's whole context T; the second is
    read as L = T - T//3 tokens, the rest of its row only pads it on the right (a causal model's first L positions
    never see it). Both run as one batch (sequences mixed in a batch show), and the shorter again alone (a class
    that handles only its full context shows)."""
    return probe_ids(model, vocab, T, seed=3, rows=2), shorter(T), proof_words(T)


def shorter(T: int) -> int:
    return max(1, T - T // 3)


def proof_words(T: int) -> str:
    return f"2 sequences of {T} and {shorter(T)} tokens, batched and apart"


class _Enough(Exception):
    """Raised from the reference's observer once its final norm is out: its logits are made a few rows at a time."""


def _finals(ref: Float64GPT2, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(the reference's float64 final-norm output for each input, its head): whole (T, vocab) float64 logits of
    both sequences would cost 0.7 GB beside the class at 1024 positions."""
    got: list[torch.Tensor] = []

    def observe(st):
        if st.kind == "final":
            got.extend(st.values["out"])
            raise _Enough

    try:
        ref.forward(inputs, observe=observe)
    except _Enough:
        pass
    return got, ref.files.get("wte.weight" if ref.config.tied else "lm_head.weight")


def _gap(pairs, head: torch.Tensor, rows: int = 128) -> float:
    """max|ours - ref| / max|ref| over (the class's logits, the reference's final-norm output) pairs."""
    d, m = 0.0, 0.0
    for ours, final in pairs:
        for s in range(0, final.shape[-2], rows):
            r = logits64(final[..., s:s + rows, :], head)
            d, m = max(d, max_errors([(ours[..., s:s + rows, :], r)])[0]), max(m, absmax(r))
    return ratio(d, m)


def _runs(stages: ModelStages, ids: torch.Tensor, L: int, ref: Float64GPT2) -> dict:
    """The class's logits against `ref`'s: {"batch": rel, "alone": rel} (the batch's rows to each sequence's own
    length; the shorter sequence run alone), and what the reference computed ("finals", "head")."""
    finals, head = _finals(ref, [ids[:1].cpu(), ids[1:, :L].cpu()])
    with torch.random.fork_rng(devices=[]), evaluating(stages.model):
        batch = stages.logits(ids).float().cpu()
        out = {"batch": _gap([(batch[:1], finals[0]), (batch[1:, :L], finals[1])], head)}
        del batch
        alone = stages.logits(ids[1:, :L]).float().cpu()
    return {**out, "alone": _gap([(alone, finals[1])], head), "finals": finals, "head": head}


@torch.no_grad()
def prove(model: nn.Module, lay: UserLayout, ref: Float64GPT2) -> dict:
    """The class's logits against `ref` on two random sequences over its whole context (proof_ids): {"rel",
    "tokens", "lengths", "words", "tolerance", "passed", "first_divergence"}. Where they differ, every stage is run
    on the reference's own input for that stage (teacher-forced, as verify localizes) and the first that differs is
    named, with the known mistake that explains it where one does; a class right for each sequence alone but not
    for the two batched is told so."""
    T = context(model, lay)
    ids, L, words = proof_ids(model, lay.config.vocab_size, T)
    stages = ModelStages(model, lay)
    tol = TOLERANCES.get(DTYPE_LABELS.get(stages.dtype, "fp32"), TOLERANCES["bf16"])
    runs = _runs(stages, ids, L, ref)
    rel = max(runs["batch"], runs["alone"])
    out = {"rel": rel, "tokens": T, "lengths": (T, L), "words": words, "tolerance": tol.logits_rel,
           "passed": rel <= tol.logits_rel, "first_divergence": None}
    if out["passed"]:
        return out
    if runs["batch"] > tol.logits_rel:
        mixed = _mixed(stages, ids, runs, tol.logits_rel)
        where = _localize(stages, ids, ref, tol.local_rel)
        found = where or f"logits differ (rel {runs['batch']:.2e} > {tol.logits_rel:.2g})"
        out["first_divergence"] = (f"the sequences of a batch are mixed: each alone computes GPT-2, batched they "
                                   f"differ ({found})" if mixed else found)
    else:
        where = _localize(stages, ids[1:, :L], ref, tol.local_rel)
        out["first_divergence"] = f"the {L}-token sequence alone: " + (
            where or f"logits differ (rel {runs['alone']:.2e} > {tol.logits_rel:.2g}); batched at {T} they agree")
    return out


def _mixed(stages: ModelStages, ids: torch.Tensor, runs: dict, tol: float) -> bool:
    """Whether the first sequence alone computes GPT-2 too (the second alone was measured): the batch mixes them."""
    if runs["alone"] > tol:
        return False
    with torch.random.fork_rng(devices=[]), evaluating(stages.model):
        first = stages.logits(ids[:1]).float().cpu()
    return _gap([(first, runs["finals"][0])], runs["head"]) <= tol


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


@torch.no_grad()
def against_gpt2(model: nn.Module, lay: UserLayout, ref: Float64GPT2) -> float:
    """The class's end-to-end difference from `ref` on the proof's inputs (logits only)."""
    ids, L, _ = proof_ids(model, lay.config.vocab_size, context(model, lay))
    runs = _runs(ModelStages(model, lay), ids, L, ref)
    return max(runs["batch"], runs["alone"])
