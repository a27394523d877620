"""Deciding by numbers: what names and shapes leave open (which of three weights is q, whether a square weight is
stored transposed) is settled by running each candidate reading of the class against gpt2port's own GPT on a short
input and keeping the one that matches; and what a class without GPT-2's biases loses is measured the same way."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from gpt2port.config import GPTConfig
from gpt2port.errors import GPT2PortError
from gpt2port.layouts import canonical
from gpt2port.userclass.layout import UserLayout
from gpt2port.userclass.observe import call_logits, evaluating, probe_ids
from gpt2port.userclass.roles import context

MATCH_REL = {torch.float32: 1e-4, torch.float64: 1e-6}  # a candidate matches within this (else 3e-2: half types)


def reference_gpt(config: GPTConfig, kept: dict[str, torch.Tensor]):
    """gpt2port's own GPT over the canonical tensors (no copies)."""
    from gpt2port.model import GPT

    with torch.device("meta"):
        ref = GPT(config)
    state = dict(kept)
    tied = canonical.HEAD not in state
    if tied:
        state[canonical.HEAD] = state[canonical.EMBEDDING]
    ref.load_state_dict(state, assign=True, strict=True)
    if tied:
        ref.lm_head.weight = ref.tok_emb.weight
    return ref.eval()


@torch.no_grad()
def run(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.random.fork_rng(devices=[]), evaluating(model):
        return call_logits(model, ids).float().cpu()


def settle(model: nn.Module, lay: UserLayout, candidates: list[dict], build: Callable[[dict], tuple], ref,
           kept: dict, config: GPTConfig, fill) -> UserLayout:
    """Try every candidate reading; keep (and leave loaded) the one whose logits match gpt2port's GPT."""
    ids = probe_ids(model, config.vocab_size, min(16, context(model, lay)), seed=1)
    want = run(ref, ids.cpu())  # gpt2port's GPT over the canonical tensors lives on the CPU
    items = [(k, None, None, (lambda t=t: t)) for k, t in kept.items()]
    dtype = next(model.parameters()).dtype
    tol = MATCH_REL.get(dtype, 3e-2)
    tried = []
    for opts in candidates:
        cand, pk = build(opts)
        if cand.reasons:  # this reading does not even fit the shapes
            continue
        fill(model, cand.assignments, items, False)
        got = run(model, ids)
        rel = float((got - want).abs().max() / want.abs().max()) if got.shape == want.shape else float("inf")
        rel = float("inf") if rel != rel else rel  # NaN logits (a fully masked row) match nothing
        tried.append((rel, opts, cand, pk))
        if rel <= tol:
            break
    if not tried:
        raise GPT2PortError(f"{lay.model_name}: no reading of the class fits GPT-2's shapes")
    rel, opts, best, pk = min(tried, key=lambda x: x[0])
    if best is not tried[-1][2]:
        best, pk = build(opts)  # again: building may set more than parameters (mask buffers)
        fill(model, best.assignments, items, False)
    words = "; ".join(pk.describe(opts)) or "as read"
    if rel > tol:  # left loaded: the proof then names the stage at fault in the closest reading
        best.unsettled = (f"no reading of the class computes GPT-2 (tried {len(tried)}); the closest ({words}) is "
                          f"off by {rel:.3g} relative in its logits")
        return best
    best.decided = [f"{w} (logits match gpt2port's GPT to {rel:.2g}; {len(tried)} of {len(candidates)} "
                    f"readings tried)" for w in pk.describe(opts)]
    return best


@torch.no_grad()
def bias_cost(model: nn.Module, ref, config: GPTConfig, lay: UserLayout, greedy_tokens: int = 16) -> dict:
    """What the class loses against GPT-2 without the biases it lacks: logit error, KL and top-1 over every
    position of a random input, and how many tokens of GPT-2's greedy continuation the class's own greedy decoding
    reproduces before it first picks another token.

    GPT-2's continuation is decoded through its KV cache; the class then runs once over it (teacher-forced): while
    the class agrees, its own greedy prefix is GPT-2's, so its choice at each step given GPT-2's prefix is its
    greedy choice, up to and including the first disagreement."""
    from gpt2port.generate import decode
    from gpt2port.verification.metrics import compare_logits

    T = min(64, context(model, lay))
    ids = probe_ids(model, config.vocab_size, T, seed=2)
    m = compare_logits(run(model, ids), run(ref, ids.cpu()), 1e-4)
    prompt = ids[:, : max(1, T // 4)].cpu()
    n = min(greedy_tokens, T - prompt.shape[1])
    agree = n
    if n:
        with torch.random.fork_rng(devices=[]), evaluating(ref):
            gpt2 = torch.stack([t for t, _ in decode(ref, prompt, n, temperature=0, stop_token=None)], dim=1)
        seq = torch.cat([prompt, gpt2], dim=1)[:, :-1]
        picks = run(model, seq.to(ids.device))[:, prompt.shape[1] - 1:].argmax(-1)
        wrong = (picks != gpt2)[0].nonzero()
        agree = int(wrong[0]) if len(wrong) else n
    return {"max_rel": m["max_rel"], "kl_mean": m["kl_mean"], "top1": m["top1"],
            "greedy_agreement": agree / n if n else 1.0, "greedy_tokens": n}
