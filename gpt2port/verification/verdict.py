"""The verdict: every measure held against its tolerance, one Check each, the localization first."""

from __future__ import annotations

import math

from gpt2port.verification.report import Check, VerifyReport
from gpt2port.verification.tolerances import Tolerance


def judge(report: VerifyReport, inputs, per_input, tol: Tolerance, known_answer: bool, kv_cached: bool) -> list[Check]:
    checks: list[Check] = []
    loc = report.localization
    stages = loc["stages"]
    first = next((s for s in stages if not s["passed"]), None)
    worst = max(stages, key=lambda s: s["rel"])
    checks.append(Check("every stage in isolation", first is None, worst["rel"], tol.local_rel,
                        loc["first_divergence"] or f"worst: {worst['stage']}"))
    o = report.metrics["overall"]["ours_vs_f64"]
    checks.append(Check("logits vs float64 (max rel)", o["max_rel"] <= tol.logits_rel, o["max_rel"], tol.logits_rel,
                        "" if o["max_rel"] <= tol.logits_rel or first else _unexplained(o["max_rel"],
                        "every stage matches alone: forward() wires them differently")))
    checks.append(Check("next-token KL vs float64", o["kl_mean"] <= tol.kl, o["kl_mean"], tol.kl))
    checks.append(Check("top-1 flips beyond near-ties", o["top1_unexplained"] == 0, o["top1_unexplained"], 0,
                        f"top-1 agreement {100 * o['top1']:.2f}%"))
    g = report.metrics["overall"].get("greedy")
    if g:
        ok = g["cached_max_rel"] <= tol.logits_rel
        if kv_cached:
            checks.append(Check("KV-cached decode vs float64", ok, g["cached_max_rel"], tol.logits_rel,
                                "logits of each greedy step"))
        else:
            checks.append(Check("decode steps vs float64", ok, g["cached_max_rel"], tol.logits_rel,
                                "logits of each greedy step, recomputed in full (no KV cache)"))
        checks.append(Check("greedy tokens = float64 top-1", g["unexplained"] == 0, f"{g['match_f64']}/{g['steps']}",
                            None, f"{g['unexplained']} steps off beyond a near-tie" if g["unexplained"] else ""))
    loss = report.metrics["overall"].get("loss")
    if loss:
        checks.append(Check("loss on natural text vs float64", loss["max_diff"] <= tol.loss, loss["max_diff"],
                            tol.loss, f"ours {loss['ours']:.4f}, float64 {loss['f64']:.4f} nats"))
    if report.reference.get("hf"):
        h, oh = report.metrics["overall"]["hf_vs_f64"], report.metrics["overall"]["ours_vs_hf"]
        checks.append(Check("HF vs float64 (references agree)", h["max_rel"] <= tol.logits_rel, h["max_rel"],
                            tol.logits_rel, "" if h["max_rel"] <= tol.logits_rel else _unexplained(h["max_rel"],
                            "the two references disagree: check the HF config/files")))
        vs_hf = tol.logits_rel * tol.vs_hf_factor
        checks.append(Check("logits vs HF (max rel)", oh["max_rel"] <= vs_hf, oh["max_rel"], vs_hf))
        if g:
            splits = [i.name for i in inputs if "greedy" in per_input[i.name]
                      and not per_input[i.name]["greedy"]["hf_split_explained"]]
            checks.append(Check("greedy tokens = HF's (own KV cache)", not splits, f"{g['match_hf']}/{g['steps']}",
                                None, f"split beyond a near-tie in {', '.join(splits)}" if splits else ""))
    if known_answer:
        checks.append(_known_answer_check(inputs, per_input))
    return checks


def _unexplained(rel: float, why: str) -> str:
    """A NaN error is the logits' own NaN or Inf (where both sides are NaN, they are not wired differently)."""
    return "the logits hold NaN or Inf" if math.isnan(rel) else why


def _known_answer_check(inputs, per_input) -> Check:
    inp = next(i for i in inputs if i.kind == "known")
    k = per_input[inp.name]["known_answer"]
    name = "known answer (greedy from 'The dog')"
    if k["match"]:
        return Check(name, True, "match", detail=f"{len(k['tokens'])} tokens as in transformers' test suite")
    s = k["split"]
    detail = f"new token {s}: got {k['tokens'][s:s + 3]}..., expected {inp.expected[s:s + 3]}..."
    if k["explained"]:
        return Check(name, True, "near-tie split", detail=detail + " (a near-tie at this precision)")
    return Check(name, False, "mismatch", detail=detail)
