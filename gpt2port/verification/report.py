"""The result of `gpt2port verify`: a PASS/FAIL table for people and a stable JSON document for machines.

JSON schema "gpt2port.verify/1" (keys are only ever added, never renamed or removed within a schema version):

    schema        "gpt2port.verify/1"
    passed        bool; verdict "PASS" | "FAIL"
    failures      [str]: one line per failed check, the localization ("block 7: attention output differs") first
    checkpoint    str; reference {"path", "float64": true, "hf": bool, "hf_version": str|null, "hf_note": str|null,
                  "hf_dtype": str|null (what HF computed in; null when it did not run)}
    dtype         "fp32" | "fp16" | "bf16" | "int8": what ours computed in (HF: the same, fp32 beside int8);
                  weights_dtype: what the checkpoint stores
    model         {"n_layer", "n_head", "n_embd", "n_positions", "vocab_size", "n_params"}
    tolerances    {"logits_rel", "kl", "local_rel", "loss", "vs_hf_factor"}
    inputs        [{"name", "kind": "prompt"|"known"|"random", "shape": [B, T], "texts": [str]|null}]
    metrics       {"overall": {"ours_vs_f64", "hf_vs_f64", "ours_vs_hf"}, "per_input": {name: {...}}}
                  each comparison: {"positions", "max_abs", "max_rel", "kl_mean", "top1", "top1_unexplained",
                  "top5"} or null when HF is absent; per_input adds "loss" and "greedy" for prompts
    localization  {"first_divergence": str|null, "stages": [{"stage", "block", "part", "max_abs", "rel",
                  "tolerance", "passed"}], "stream": [{"block", "max_abs", "rel"}], "diagnosis": null|{"stage",
                  "rel_before", "tolerance", "explained_by": str|null, "advice", "rel_with", "closest",
                  "measured_against", "history": bool (explained by what was done to the model before, e.g. biases
                  dropped at load or fine-tuning: verification/history.py), "tried": [{"mistake", "rel", "on"}],
                  "non_finite": [str] (only where the reference's weights of that stage hold NaN or Inf: their
                  names)} (diagnose.py)}
    checks        [{"name", "passed", "value", "tolerance", "detail"}]
    notes         [str]; timings {"ours", "reference", "hf", "total"} in seconds (null: phase not run)

Non-finite numbers (a NaN anywhere fails as an infinite error) appear as the strings "inf", "-inf", "nan", so the
document is strict JSON.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

SCHEMA = "gpt2port.verify/1"


@dataclass
class Check:
    name: str
    passed: bool
    value: float | int | str | None = None
    tolerance: float | int | str | None = None
    detail: str = ""


@dataclass
class VerifyReport:
    checkpoint: str
    reference: dict
    dtype: str
    weights_dtype: str
    model: dict
    tolerances: dict
    inputs: list[dict] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    localization: dict = field(default_factory=lambda: {"first_divergence": None, "stages": [], "stream": [],
                                                        "diagnosis": None})
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    timings: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[str]:
        lines = [f"{c.name}: {c.detail}" if c.detail else c.name for c in self.checks if not c.passed]
        first = self.localization.get("first_divergence")
        return ([first] if first else []) + lines

    def to_dict(self) -> dict:
        return _finite({
            "schema": SCHEMA,
            "passed": self.passed,
            "verdict": "PASS" if self.passed else "FAIL",
            "failures": self.failures,
            "checkpoint": self.checkpoint,
            "reference": self.reference,
            "dtype": self.dtype,
            "weights_dtype": self.weights_dtype,
            "model": self.model,
            "tolerances": self.tolerances,
            "inputs": self.inputs,
            "metrics": self.metrics,
            "localization": self.localization,
            "checks": [asdict(c) for c in self.checks],
            "notes": self.notes,
            "timings": self.timings,
        })

    def to_text(self) -> str:
        return render_text(self)


def _finite(x):
    """Strict JSON has no Infinity/NaN: such numbers become the strings "inf", "-inf", "nan"."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _num(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    if x == 0:
        return "0"
    return f"{x:.2e}" if abs(x) < 1e-2 or abs(x) >= 1e4 else f"{x:.4g}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def render_text(r: VerifyReport) -> str:
    """The terminal report: what was compared, a metrics table, one line per check, the verdict last."""
    m = r.model
    ref = r.reference
    hf = f"transformers {ref['hf_version']} GPT2LMHeadModel in {ref.get('hf_dtype') or r.dtype}" if ref.get("hf") else \
        f"HF transformers not used ({ref.get('hf_note') or 'not installed'})"
    lines = [
        f"gpt2port verify  {r.checkpoint}",
        f"  model      {m['n_layer']} layers, {m['n_embd']} wide, {m['n_params']:,} params; "
        f"{r.weights_dtype} weights, computing in {r.dtype}",
        f"  reference  {ref['path']}",
        f"             float64 forward over the HF files (truth); {hf}",
        f"  inputs     {_describe_inputs(r.inputs)}",
        "",
    ]
    overall = r.metrics.get("overall", {})
    if overall.get("ours_vs_f64"):
        lines += _metrics_table(r, overall)
        lines.append("")
    lines.append("  checks")
    for c in r.checks:
        value = f"{_num(c.value)}" + (f" (tol {_num(c.tolerance)})" if c.tolerance is not None else "")
        lines.append(f"    {'PASS' if c.passed else 'FAIL'}  {c.name:<34} {value:<28} {c.detail}".rstrip())
    if not r.passed and r.localization.get("stages"):
        lines += ["", *_localization_excerpt(r.localization)]
    for n in r.notes:
        lines.append(f"  note: {n}")
    total = r.timings.get("total")
    lines.append("")
    verdict = "PASS" if r.passed else "FAIL"
    why = f": {r.failures[0]}" if not r.passed and r.failures else ""
    lines.append(f"{verdict}{why}" + (f"  ({total:.1f}s)" if total is not None else ""))
    return "\n".join(lines)


def _describe_inputs(inputs: list[dict]) -> str:
    prompts = [i for i in inputs if i["kind"] == "prompt"]
    known = [i for i in inputs if i["kind"] == "known"]
    rand = [i for i in inputs if i["kind"] == "random"]
    parts = []
    for i in prompts:
        B, T = i["shape"]
        parts.append(f"{B} {'natural-text' if i['texts'] else 'random-id'} prompts + greedy continuations ({B}x{T})")
    if known:
        parts.append("the known-answer prompt")
    parts += [f"random ids {'x'.join(map(str, i['shape']))}" for i in rand]
    return ", ".join(parts) or "none"


def _metrics_table(r: VerifyReport, overall: dict) -> list[str]:
    cols = [("ours vs f64", overall.get("ours_vs_f64")), ("HF vs f64", overall.get("hf_vs_f64")),
            ("ours vs HF", overall.get("ours_vs_hf"))]
    tol = r.tolerances
    rows = [
        ("logits max |diff|", "max_abs", _num, None),
        ("logits max rel. error", "max_rel", _num, tol.get("logits_rel")),
        ("next-token KL(ref||ours), mean", "kl_mean", _num, tol.get("kl")),
        ("top-1 agreement", "top1", _pct, None),
        ("top-5 overlap", "top5", _pct, None),
    ]
    out = [f"  {'':<32}" + "".join(f"{name:>14}" for name, _ in cols) + f"{'tolerance':>12}"]
    for label, key, fmt, t in rows:
        cells = "".join(f"{fmt(c.get(key)) if c else '-':>14}" for _, c in cols)
        out.append(f"  {label:<32}{cells}{_num(t) if t is not None else '':>12}")
    g = overall.get("greedy")
    if g:
        cells = [f"{g['match_f64']}/{g['steps']}", "-",
                 f"{g['match_hf']}/{g['steps']}" if g.get("match_hf") is not None else "-"]
        out.append(f"  {'greedy tokens = reference top-1':<32}" + "".join(f"{c:>14}" for c in cells))
    loss = overall.get("loss")
    if loss:
        hf_loss = f", HF {loss['hf']:.4f}" if loss.get("hf") is not None else ""
        out.append(f"  {'loss on natural text (nats)':<32}{'ours ' + format(loss['ours'], '.4f'):>14}"
                   f"   (float64 {loss['f64']:.4f}{hf_loss})")
    return out


def _localization_excerpt(loc: dict) -> list[str]:
    """The stages around the first divergence, judged one at a time on the reference's own inputs."""
    stages = loc["stages"]
    first = next((k for k, s in enumerate(stages) if not s["passed"]), None)
    lines = ["  localization (each stage fed the reference's own input; rel = max|diff| / max|ref|)"]
    lines += [f"    not run apart (judged within the whole): {u}" for u in loc.get("unobserved", [])[:2]]
    if first is None:
        lines.append("    every stage matches in isolation: the difference comes from how forward() wires them")
        return lines
    for s in stages[max(0, first - 2): first + 3]:
        lines.append(f"    {'ok  ' if s['passed'] else 'DIFF'}  {s['stage']:<24} rel {_num(s['rel']):<10} "
                     f"max|diff| {_num(s['max_abs'])}")
    return lines
