"""Perplexity over one long text, by the Hugging Face guide's sliding window, and a model against its base.

The text is tokenized once. Windows of up to the model's context advance by `stride`; each window is scored only on
the tokens no earlier window predicted, so every token after the first is predicted exactly once, each with at least
context - stride tokens before it (where the text has them). With a stride below the context this is the guide's
loop, window for window. At a stride equal to the context (no overlap), the guide leaves each window's first token
unpredicted; here that token is predicted from the one before it, as lm-evaluation-harness's rolling windows do.

A window reads tokens[a:end-1] and predicts tokens[a+1:end]; a causal model's logits at a position do not depend on
what follows, so windows of unequal length share a batch right-padded, with no mask.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

import torch

from gpt2port.errors import GPT2PortError
from gpt2port.evaluation.load import logits
from gpt2port.evaluation.ranks import ONE, Ranks
from gpt2port.progress import rate

TOKENS_PER_BATCH = 4096  # windows per forward: 4 at GPT-2's context (0.8 GB of fp32 logits)


def plan(n_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """[(a, first, end)]: the window reads tokens[a:end-1]; it is scored on predicting tokens[first:end]."""
    windows, begin, done = [], 0, 1
    while done < n_tokens:
        end = min(begin + context, n_tokens)
        windows.append((min(begin, done - 1), done, end))
        done, begin = end, begin + stride
    return windows


def check_stride(stride: int | None, context: int) -> int:
    if stride is None:
        return max(1, context // 2)
    if not 1 <= stride <= context:
        raise GPT2PortError(f"--stride {stride}: must be between 1 and the model's context ({context})")
    return stride


@dataclass
class Totals:
    """Sums over every predicted token (float64: a million tokens' nll summed in fp32 loses digits)."""
    tokens: int = 0
    nll: float = 0.0
    base_nll: float = 0.0
    kld: float = 0.0
    kld_max: float = 0.0
    top1: int = 0
    against: bool = False

    def add(self, part: "Totals") -> None:
        self.tokens += part.tokens
        self.nll += part.nll
        self.base_nll += part.base_nll
        self.kld += part.kld
        self.kld_max = max(self.kld_max, part.kld_max)
        self.top1 += part.top1


def perplexity(model, ids: list[int], text: str, stride: int | None, base=None, progress=None,
               tokens_per_batch: int = TOKENS_PER_BATCH, ranks: Ranks = ONE) -> dict:
    """The figures over `ids` (the tokens of `text`); with `base`, also KL(base || model) and top-1 agreement.
    Under torchrun each rank scores its share of the batches; the sums are added in batch order, as one process
    adds them."""
    context = model.config.n_positions
    for what in ("n_positions", "vocab_size") if base is not None else ():
        if getattr(base.config, what) != getattr(model.config, what):
            raise GPT2PortError(f"--against: its {what} ({getattr(base.config, what)}) differs from the model's "
                                f"({getattr(model.config, what)}); KL needs the same windows and vocabulary")
    stride = check_stride(stride, context)
    windows = plan(len(ids), context, stride)
    tokens = torch.tensor(ids, dtype=torch.long)
    per_batch = max(1, tokens_per_batch // context)
    device = model.pos_emb.weight.device
    found, t0 = {}, time.perf_counter()
    for number, i in enumerate(range(0, len(windows), per_batch)):
        if progress:
            progress(f"window {i}/{len(windows)}{rate(i, len(windows), t0, 'windows')}")
        if ranks.mine(number):
            found[number] = _score(model, base, tokens, windows[i:i + per_batch], device)
    if progress:
        progress(f"window {len(windows)}/{len(windows)}{rate(len(windows), len(windows), t0, 'windows')}")
    found = ranks.gather(found)
    totals = Totals(against=base is not None)
    for number in sorted(found):
        totals.add(found[number])
    return figures(totals, text, stride, context, len(windows))


@torch.no_grad()
def _score(model, base, tokens: torch.Tensor, batch, device) -> Totals:
    """The sums over one batch of windows."""
    totals = Totals()
    width = max(end - 1 - a for a, _, end in batch)
    idx = torch.zeros(len(batch), width, dtype=torch.long)
    rows, cols, targets = [], [], []
    for r, (a, first, end) in enumerate(batch):
        idx[r, : end - 1 - a] = tokens[a : end - 1]
        rows += [r] * (end - first)
        cols += range(first - 1 - a, end - 1 - a)
        targets.append(tokens[first:end])
    rows, cols = torch.tensor(rows, device=device), torch.tensor(cols, device=device)
    target = torch.cat(targets).to(device)
    idx = idx.to(device)
    keep = width - int(cols.min())  # the head only where some row is scored: the last `stride` of a full window
    cols -= width - keep
    lp = torch.log_softmax(logits(model, idx, keep=keep)[rows, cols].float(), dim=-1)
    totals.tokens += len(target)
    totals.nll -= lp.gather(1, target[:, None]).double().sum().item()
    if base is None:
        return totals
    lb = torch.log_softmax(logits(base, idx.to(base.pos_emb.weight.device), keep=keep)[rows, cols].float().to(device),
                           dim=-1)
    totals.base_nll -= lb.gather(1, target[:, None]).double().sum().item()
    kl = (lb.exp() * (lb - lp)).sum(-1)  # KL(base || model) per token, nats
    totals.kld += kl.double().sum().item()
    totals.kld_max = max(totals.kld_max, kl.max().item())
    totals.top1 += int((lb.argmax(-1) == lp.argmax(-1)).sum())
    return totals


def figures(t: Totals, text: str, stride: int, context: int, n_windows: int) -> dict:
    """lm-evaluation-harness's wikitext normalizations: words split on runs of whitespace, bytes of UTF-8."""
    words, n_bytes = len(re.split(r"\s+", text)), len(text.encode("utf-8"))
    out = {"tokens": t.tokens, "nll": t.nll / t.tokens, "perplexity": _exp(t.nll / t.tokens),
           "word_perplexity": _exp(t.nll / words), "byte_perplexity": _exp(t.nll / n_bytes),
           "bits_per_byte": t.nll / n_bytes / math.log(2), "words": words, "bytes": n_bytes, "stride": stride,
           "context": context, "windows": n_windows}
    if t.against:
        base_ppl = _exp(t.base_nll / t.tokens)
        out.update({"kld": t.kld / t.tokens, "kld_max": t.kld_max, "top1_agreement": t.top1 / t.tokens,
                    "base_perplexity": base_ppl, "perplexity_difference": out["perplexity"] - base_ppl})
    return out


def _exp(x: float) -> float:
    return math.exp(x) if x < 700 else float("inf")
