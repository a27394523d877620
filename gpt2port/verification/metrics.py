"""Error measures of one implementation's logits against another's, all computed in float64.

  max_rel   max|ours - ref| / max|ref| over an input: scale-free, so one tolerance serves every model size
  kl_mean   mean over positions of KL(softmax(ref) || softmax(ours)) in nats
  top1      fraction of positions with the same argmax; a flip is "unexplained" when the reference's own margin
            between the two tokens exceeds twice the tolerated logit error (near-ties may flip in fp16/bf16)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

CHUNK = 64  # positions per step when comparing logits: a dozen float64 temporaries of 64 x vocab (26 MB each)


def num(x) -> float:
    """A tensor scalar as float, NaN as +inf: max() would silently skip a NaN, and a NaN must fail every check."""
    x = float(x)
    return math.inf if math.isnan(x) else x


def absmax(t: torch.Tensor) -> float:
    return max(num(t.max()), -float(t.min()))  # max|t| without a full-size temporary


def ratio(d: float, scale: float) -> float:
    if math.isinf(d):  # a NaN or Inf on either side (inf / inf would be a NaN, which max() skips)
        return math.inf
    return d / scale if scale > 0 else (0.0 if d == 0 else float("inf"))


def max_errors(pairs) -> tuple[float, float]:
    """(max|ours - ref| over all pairs, max over pairs of max|ours - ref| / max|ref|), in float64."""
    max_abs, rel = 0.0, 0.0
    for ours, ref in pairs:
        o, r = ours.reshape(-1, ours.shape[-1]), ref.reshape(-1, ref.shape[-1])
        d = max(num((o[s:s + CHUNK].to(torch.float64) - r[s:s + CHUNK]).abs().max())
                for s in range(0, r.shape[0], CHUNK))
        max_abs, rel = max(max_abs, d), max(rel, ratio(d, absmax(r)))
    return max_abs, rel


def compare_logits(ours: torch.Tensor, ref: torch.Tensor, tol_rel: float) -> dict:
    """Error of `ours` against `ref` over every position of one input (see the module docstring)."""
    o_all, r_all = ours.reshape(-1, ours.shape[-1]), ref.reshape(-1, ref.shape[-1])
    scale = absmax(r_all)
    allow = 2 * tol_rel * scale
    n = r_all.shape[0]
    max_abs = kl = 0.0
    agree = unexplained = top5 = 0
    for s in range(0, n, CHUNK):
        o, r = o_all[s:s + CHUNK].to(torch.float64), r_all[s:s + CHUNK].to(torch.float64)
        max_abs = max(max_abs, num((o - r).abs().max()))
        logp, logq = F.log_softmax(r, dim=-1), F.log_softmax(o, dim=-1)
        kl += num((logp.exp() * (logp - logq)).sum().clamp_min(0))  # >= 0 in exact arithmetic
        r_top, o_top = r.argmax(-1), o.argmax(-1)
        agree += int((r_top == o_top).sum())
        margin = r.gather(1, r_top[:, None]) - r.gather(1, o_top[:, None])
        unexplained += int((margin > allow).sum())
        r5, o5 = r.topk(5, dim=-1).indices, o.topk(5, dim=-1).indices
        top5 += int((r5[:, :, None] == o5[:, None, :]).any(-1).sum())
    return {"positions": n, "max_abs": max_abs, "max_rel": ratio(max_abs, scale),
            "kl_mean": kl / n, "top1": agree / n, "top1_unexplained": unexplained, "top5": top5 / (5 * n),
            "scale": scale}


def loss(logits: torch.Tensor, ids: torch.Tensor, n: int) -> float:
    """Mean next-token cross-entropy over the first n tokens of every row, in float64."""
    return float(F.cross_entropy(logits[:, : n - 1].flatten(0, 1).to(torch.float64), ids[:, 1:n].flatten()))


# --- greedy continuations ----------------------------------------------------------------------------------------

def near_tie_split(ours: list[int], theirs: list[int], ref_rows: torch.Tensor, allow: float) -> tuple[int | None, bool]:
    """Where two greedy token sequences first differ, and whether a near-tie explains it.

    ref_rows (n, vocab) are the reference's logits at the positions that chose ours' tokens. Up to the split both
    sequences are equal, so the row at the split judges the other sequence's token too: the split is explained when
    the reference rates the two tokens within `allow` of each other.
    """
    split = next((k for k, (x, y) in enumerate(zip(ours, theirs)) if x != y), None)
    if split is None:
        return None, True
    row = ref_rows[split]
    return split, bool(abs(float(row[ours[split]] - row[theirs[split]])) <= allow)


def greedy_vs_ref(inp, ref: torch.Tensor, allow: float) -> dict:
    """Did every greedy step pick the reference's top token (a near-tie within `allow` may go either way)?"""
    rows = ref[:, inp.greedy_cols()]
    best = rows.argmax(-1)
    margin = rows.gather(-1, best[..., None])[..., 0] - rows.gather(-1, inp.greedy[..., None])[..., 0]
    return {"steps": inp.greedy.numel(), "match_f64": int((best == inp.greedy).sum()),
            "unexplained": int((margin > allow).sum()), "ours_tokens": inp.greedy.tolist()}


def greedy_vs_hf(inp, hf_tokens: torch.Tensor, ref: torch.Tensor, allow: float) -> dict:
    """How far HF's own greedy run (its KV cache) agrees with ours, row by row; a split is explained by a near-tie."""
    same, explained = 0, True
    for b, (ours, theirs) in enumerate(zip(inp.greedy.tolist(), hf_tokens.tolist())):
        split, tie = near_tie_split(ours, theirs, ref[b, inp.greedy_cols()], allow)
        same += len(ours) if split is None else split
        explained &= tie
    return {"hf_tokens": hf_tokens.tolist(), "match_hf": same, "hf_split_explained": explained}


def known_vs_expected(inp, ref: torch.Tensor, allow: float) -> dict:
    got = inp.greedy[0].tolist()
    split, tie = near_tie_split(got, inp.expected, ref[0, inp.greedy_cols()], allow)
    return {"match": split is None, "split": split, "explained": tie, "tokens": got}


# --- per input and overall ---------------------------------------------------------------------------------------

def prompt_metrics(inputs, ours_logits, ref_logits, hf, per_input, tol) -> None:
    """Greedy, known-answer and loss measures of the inputs that have them, added to per_input."""
    for k, inp in enumerate(inputs):
        if inp.greedy is None:
            continue
        entry = per_input[inp.name]
        r = ref_logits[k]
        scale = absmax(r)
        allow = 2 * tol.logits_rel * scale
        g = greedy_vs_ref(inp, r, allow)
        cached_abs = num((inp.step_logits.to(torch.float64) - r[:, inp.greedy_cols()]).abs().max())
        g["cached_max_rel"] = ratio(cached_abs, scale)
        if hf is not None:
            g.update(greedy_vs_hf(inp, hf["greedy"][inp.name], r, allow))
        entry["greedy"] = g
        if inp.kind == "known":
            entry["known_answer"] = known_vs_expected(inp, r, allow)
        if inp.text_len >= 2:
            entry["loss"] = {"ours": loss(ours_logits[k], inp.ids, inp.text_len),
                             "f64": loss(r, inp.ids, inp.text_len),
                             "hf": hf["loss"][inp.name] if hf is not None else None}


def overall(inputs, per_input) -> dict:
    out = {}
    for key in ("ours_vs_f64", "hf_vs_f64", "ours_vs_hf"):
        rows = [per_input[i.name].get(key) for i in inputs]
        if any(r is None for r in rows):
            out[key] = None
            continue
        n = sum(r["positions"] for r in rows)
        out[key] = {"positions": n,
                    "max_abs": max(r["max_abs"] for r in rows),
                    "max_rel": max(r["max_rel"] for r in rows),
                    "kl_mean": sum(r["kl_mean"] * r["positions"] for r in rows) / n,
                    "top1": sum(r["top1"] * r["positions"] for r in rows) / n,
                    "top1_unexplained": sum(r["top1_unexplained"] for r in rows),
                    "top5": sum(r["top5"] * r["positions"] for r in rows) / n}
    greedy = [per_input[i.name]["greedy"] for i in inputs if "greedy" in per_input[i.name]]
    if greedy:
        with_hf = all("match_hf" in g for g in greedy)
        out["greedy"] = {"steps": sum(g["steps"] for g in greedy),
                         "match_f64": sum(g["match_f64"] for g in greedy),
                         "unexplained": sum(g["unexplained"] for g in greedy),
                         "cached_max_rel": max(g["cached_max_rel"] for g in greedy),
                         "match_hf": sum(g["match_hf"] for g in greedy) if with_hf else None}
    losses = [per_input[i.name]["loss"] for i in inputs if "loss" in per_input[i.name]]
    if losses:
        hf_loss = [x["hf"] for x in losses]
        out["loss"] = {"ours": sum(x["ours"] for x in losses) / len(losses),
                       "f64": sum(x["f64"] for x in losses) / len(losses),
                       "hf": None if None in hf_loss else sum(hf_loss) / len(hf_loss),
                       "max_diff": max(abs(x["ours"] - x["f64"]) for x in losses)}
    return out
