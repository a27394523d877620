"""Localization: ours' stages run on the float64 reference's own inputs ("teacher forcing") as the reference streams
past, so each stage is judged alone, errors do not pile up across blocks, and a failure names the first stage that
differs ("block 7: attention output differs")."""

from __future__ import annotations

import torch

from gpt2port.errors import GPT2PortError
from gpt2port.verification.diagnose import describe, diagnose, eval_mode
from gpt2port.verification.metrics import CHUNK, absmax, max_errors, ratio
from gpt2port.verification.reference import Stage
from gpt2port.verification.stages import Stages


class Localizer:
    """Observer of Float64GPT2.forward: records the error of every stage of ours, and of ours' own residual stream.

    streams[k] is ours' residual stream on input k as Stages.logits captured it (after the embeddings, then after
    each block); head() judges the head once the reference's logits exist. The first stage that differs is
    diagnosed (diagnose.py) while its inputs and weights are at hand.
    """

    def __init__(self, stages: Stages, inputs, streams: list[list[torch.Tensor]], tol: float, ref=None):
        self.ours, self.inputs, self.streams, self.tol, self.ref = stages, inputs, streams, tol, ref
        self.stages: list[dict] = []
        self.stream: list[dict] = []
        self.finals: list[torch.Tensor] = []
        self.diagnosis: dict | None = None
        self.unobserved: list[str] = []  # stages that could not be run apart, and why

    def _judge(self, st: Stage, stage: str, block, part: str, run, xs, refs) -> None:
        """Run ours' stage on each reference input, record its error; diagnose the first one that fails."""
        dt = self.ours.dtype
        try:
            outs = [run(x.to(dt) if x.is_floating_point() else x) for x in xs]
        except GPT2PortError as e:  # a stage the model computes where it cannot be seen apart: judged as a whole
            self.unobserved.append(f"{stage}: {e}")
            return
        self._store(stage, block, part, *max_errors(list(zip(outs, refs))))
        if self.stages[-1]["passed"] or self.diagnosis is not None or self.ref is None:
            return
        module = getattr(self.ours, "module", None)
        def in_eval():
            with torch.random.fork_rng(devices=[]), eval_mode(module):
                return [run(x.to(dt) if x.is_floating_point() else x) for x in xs]
        rerun = in_eval if module is not None and module.training else None
        if rerun is None:  # in eval mode: a forward that gives two answers to one input is its own finding
            again = _apart(outs, in_eval() if module is not None else
                           [run(x.to(dt) if x.is_floating_point() else x) for x in xs])
            if again > self.tol / 10:
                self.diagnosis = {"stage": part, "nondeterministic": again}
                return
        facts = (getattr(self.ours, "history", ()), getattr(self.ours, "stated_eps", ()))
        activation = getattr(self.ours, "activation", None)
        ids = [i.ids for i in self.inputs]
        self.diagnosis = diagnose(self.ref, st, part, xs, outs, self.tol, ids, rerun, *facts, activation=activation)
        whole = getattr(self.ours, "whole_block", None)
        if part in ("attention", "mlp") and not self.diagnosis["explained_by"] and whole is not None:
            # a block put together otherwise (parallel, residual from the normed input) is named as such
            try:
                outs = [whole(st.layer, x.to(dt)) for x in st.values["in"]]
            except GPT2PortError:
                return
            built = diagnose(self.ref, st, "block", st.values["in"], outs, self.tol, ids, None, *facts,
                             activation=activation)
            if built["explained_by"]:
                self.diagnosis = built

    def _store(self, stage: str, block, part, max_abs: float, rel: float) -> None:
        self.stages.append({"stage": stage, "block": block, "part": part, "max_abs": max_abs, "rel": rel,
                            "tolerance": self.tol, "passed": bool(rel <= self.tol)})

    def _drift(self, block, index: int, refs) -> None:
        if any(len(s) <= index for s in self.streams):  # a stream the model under test did not show
            return
        max_abs, rel = max_errors([(s[index], r) for s, r in zip(self.streams, refs)])
        self.stream.append({"block": block, "max_abs": max_abs, "rel": rel})

    @torch.no_grad()
    def observe(self, st: Stage) -> None:
        ours, v = self.ours, st.values
        if st.kind == "embeddings":
            self._judge(st, "embeddings", None, "embeddings", ours.embeddings, [i.ids for i in self.inputs], v["out"])
            self._drift(None, 0, v["out"])
        elif st.kind == "block":
            i = st.layer
            self._judge(st, f"block {i} attention", i, "attention", lambda x: ours.attention(i, x), v["in"], v["attn"])
            self._judge(st, f"block {i} MLP", i, "mlp", lambda x: ours.mlp(i, x), v["mid"], v["mlp"])
            if hasattr(ours, "whole_block") and all(s["passed"] for s in self.stages[-2:]):
                # each part right, the whole not: the parts are combined otherwise (in parallel)
                self._judge(st, f"block {i}", i, "block", lambda x: ours.whole_block(i, x), v["in"], v["out"])
            self._drift(i, i + 1, v["out"])
        else:
            self._judge(st, "final norm", None, "final_norm", ours.final_norm, v["in"], v["out"])
            self.finals = v["out"]

    @torch.no_grad()
    def head(self, ref_logits: list[torch.Tensor]) -> None:
        def chunks(f, r):  # row chunks: ours' head output never exists at full (B, T, vocab) size
            f, r = f.reshape(-1, f.shape[-1]), r.reshape(-1, r.shape[-1])
            for s in range(0, len(f), CHUNK):
                yield self.ours.head(f[s:s + CHUNK].to(self.ours.dtype)), r[s:s + CHUNK]

        max_abs, rel = 0.0, 0.0
        for f, r in zip(self.finals, ref_logits):
            d = max(max_errors([pair])[0] for pair in chunks(f, r))
            max_abs, rel = max(max_abs, d), max(rel, ratio(d, absmax(r)))
        self._store("head", None, "head", max_abs, rel)
        self.finals = []

    def result(self) -> dict:
        first = next((s for s in self.stages if not s["passed"]), None)
        message = _divergence_message(first) if first else None
        if message and self.diagnosis is not None:
            message += "; " + describe(self.diagnosis)
        out = {"first_divergence": message, "stages": self.stages, "stream": self.stream, "diagnosis": self.diagnosis}
        return {**out, "unobserved": self.unobserved} if self.unobserved else out  # only where a stage was not run


def _apart(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    """How far two runs on the same inputs are apart (relative); NaN and inf where both have them count as equal."""
    worst = 0.0
    for a, b in zip(first, second):
        a, b = (torch.nan_to_num(t.double(), nan=0.0, posinf=0.0, neginf=0.0) for t in (a, b))
        worst = max(worst, ratio(float((a - b).abs().max()), absmax(b)))
    return worst


_PART_WORDS = {"embeddings": "embeddings differ", "attention": "attention output differs",
               "mlp": "MLP output differs", "final_norm": "final LayerNorm output differs",
               "head": "head (lm_head) output differs", "block": "block output differs"}


def _divergence_message(s: dict) -> str:
    where = f"block {s['block']}: " if s["block"] is not None else ""
    return f"{where}{_PART_WORDS[s['part']]} (rel {s['rel']:.2e} > {s['tolerance']:.2g})"
