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
    if rel > tol:
        raise GPT2PortError(f"{lay.model_name}: no reading of the class computes GPT-2 (tried {len(tried)}); the "
                            f"closest ({words}) is off by {rel:.3g} relative in its logits")
    best.decided = [f"{w} (logits match gpt2port's GPT to {rel:.2g}; {len(tried)} of {len(candidates)} "
                    f"readings tried)" for w in pk.describe(opts)]
    return best


@torch.no_grad()
def bias_cost(model: nn.Module, ref, config: GPTConfig, lay: UserLayout, greedy_tokens: int = 16) -> dict:
    """What the class loses against GPT-2 without the biases it lacks: logit error, KL and top-1 over every
    position of a random input, and agreement of a greedy continuation token by token."""
    from gpt2port.verification.metrics import compare_logits

    T = min(64, context(model, lay))
    ids = probe_ids(model, config.vocab_size, T, seed=2)
    m = compare_logits(run(model, ids), run(ref, ids.cpu()), 1e-4)
    prompt = ids[:, : max(1, T // 4)]
    n = min(greedy_tokens, T - prompt.shape[1])
    a, b = _greedy(model, prompt, n), _greedy(ref, prompt.cpu(), n)
    return {"max_rel": m["max_rel"], "kl_mean": m["kl_mean"], "top1": m["top1"],
            "greedy_agreement": float((a == b).float().mean()) if n else 1.0, "greedy_tokens": n}


def _greedy(model: nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    start = ids.shape[1]
    for _ in range(n):
        ids = torch.cat([ids, run(model, ids)[:, -1].argmax(-1, keepdim=True).to(ids.device)], dim=1)
    return ids[:, start:].cpu()
