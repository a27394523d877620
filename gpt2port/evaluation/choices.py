"""Log-likelihoods of continuations after a context: LAMBADA (one continuation, greedy or not) and HellaSwag (one
of several endings), as lm-evaluation-harness computes them, and HellaSwag as build-nanogpt/llm.c score it.

The harness tokenizes a pair as its `_encode_pair` does (trailing spaces of the context move to the continuation;
the continuation's tokens are those of context + continuation after the context's own count), reads
(context + continuation)[-(context_len + 1):][:-1] and scores the continuation's last positions. Here the endings
of one context share it: the contexts of a batch of examples run once (left-padded), their keys and values are
copied to one row per ending, and the endings run as one batch after them. Examples without a shared context
(LAMBADA) are batched by length, right-padded (a causal model's logits at a position do not depend on what
follows). The head (the vocabulary projection) runs only at the positions scored.
"""

from __future__ import annotations

import time

import torch

from gpt2port.evaluation.data import Pair
from gpt2port.evaluation.load import logits
from gpt2port.evaluation.ranks import ONE, Ranks
from gpt2port.model import KVCache
from gpt2port.progress import rate

TOKENS_PER_BATCH = 4096
WASTE = 1 / 8  # the padding a batch may add to its examples' own tokens
MIN_TOKENS = 128  # ... or up to this many tokens in all


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's _encode_pair (an empty context becomes the end-of-text token, as it does)."""
    if not context:
        return [tokenizer.eot_token], _encode(tokenizer, continuation)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    whole = _encode(tokenizer, context + continuation)
    ctx = _encode(tokenizer, context)
    return ctx, whole[len(ctx):]


def encode_nanogpt(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """build-nanogpt's render_example: the context and " " + ending encoded apart."""
    return _encode(tokenizer, context), _encode(tokenizer, continuation)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, allowed_special="all")  # as HF's tokenizer reads a literal <|endoftext|>


@torch.no_grad()
def score(model, tokenizer, pairs: list[Pair], nanogpt: bool = False, progress=None,
          tokens_per_batch: int = TOKENS_PER_BATCH, ranks: Ranks = ONE) -> list[list[tuple]]:
    """For each pair, [(log-likelihood, greedy, n_tokens)] per continuation (under torchrun: every rank runs its
    share of the batches, and every rank returns all)."""
    encode = encode_nanogpt if nanogpt else encode_pair
    n_ctx = model.config.n_positions
    shared, loose = [], []  # (pair index, context, continuations); (pair, continuation, tokens read, its tokens)
    for i, pair in enumerate(pairs):
        encoded = [encode(tokenizer, pair.context, c) for c in pair.continuations]
        if len(encoded) > 1 and all(len(c) + len(k) <= n_ctx + 1 and c and k for c, k in encoded):
            shared.append((i, encoded[0][0], [k for _, k in encoded]))
        else:
            loose += [(i, j, (c + k)[-(n_ctx + 1):][:-1], k) for j, (c, k) in enumerate(encoded)]
    shared.sort(key=lambda g: -len(g[1]))
    loose.sort(key=lambda r: -len(r[2]))
    found, number, t0 = {}, 0, time.perf_counter()  # (pair, continuation) -> result; the batch's number
    for start, batch in _batches(shared, _shared_tokens, tokens_per_batch):
        if ranks.mine(number):
            for (i, _, _), result in zip(batch, _shared(model, [(g[1], g[2]) for g in batch])):
                found.update(((i, j), r) for j, r in enumerate(result))
        number += 1
        if progress:
            progress(f"example {start + len(batch)}/{len(pairs)}{rate(start + len(batch), len(pairs), t0, 'examples')}")
    for start, batch in _batches(loose, lambda b: (len(b) * len(b[0][2]), sum(len(r[2]) for r in b)),
                                 tokens_per_batch):
        if ranks.mine(number):
            for (i, j, _, _), result in zip(batch, _rows(model, [(r[2], r[3]) for r in batch])):
                found[i, j] = result
        number += 1
        if progress:
            progress(f"continuation {start + len(batch)}/{len(loose)}"
                     f"{rate(start + len(batch), len(loose), t0, 'continuations')}")
    found = ranks.gather(found)
    return [[found[i, j] for j in range(len(p.continuations))] for i, p in enumerate(pairs)]


def _shared_tokens(batch) -> tuple[int, int]:
    """(tokens run, tokens of the examples' own) of a batch of shared contexts: the contexts padded to the longest,
    the endings (batched by their own length) about their own."""
    endings = sum(len(k) for _, _, ks in batch for k in ks)
    return len(batch) * max(len(c) for _, c, _ in batch) + endings, sum(len(c) for _, c, _ in batch) + endings


def _batches(items: list, tokens, budget: int):
    """(start, batch) of consecutive items, sorted so that neighbours have like lengths: each batch as many as fit
    `budget` tokens run, and no more once padding would add over WASTE to the tokens of its own (LAMBADA's lengths
    spread from 5 to 180 tokens); at least one item, and padding is allowed up to MIN_TOKENS (a shorter forward
    uses the machine less well)."""
    start = 0
    while start < len(items):
        n = 1
        while start + n < len(items):
            run, real = tokens(items[start : start + n + 1])
            if run > budget or (run > (1 + WASTE) * real and run > MIN_TOKENS):
                break
            n += 1
        yield start, items[start : start + n]
        start += n


def _rows(model, rows: list[tuple[list[int], list[int]]]) -> list[tuple]:
    device = model.pos_emb.weight.device
    idx = torch.zeros(len(rows), max(len(r) for r, _ in rows), dtype=torch.long)
    for r, (tokens, _) in enumerate(rows):
        idx[r, : len(tokens)] = torch.tensor(tokens)
    # The head only at each row's last `keep` positions (its continuation's, and a few before it for a shorter one)
    keep = max(len(cont) for _, cont in rows)
    at = torch.tensor([len(tokens) - keep for tokens, _ in rows])[:, None] + torch.arange(keep)
    out = logits(model, idx.to(device), keep=at.clamp(min=0).to(device))
    return [_judge(out[r, keep - len(cont):], cont) for r, (_, cont) in enumerate(rows)]


def _shared(model, groups: list[tuple[list[int], list[list[int]]]]) -> list[list[tuple]]:
    """Each group's context once (one row each, left-padded: the cache hides the padding, and positions count from
    a row's first token), then every continuation after its context (one row each, right-padded), in batches of
    like length whatever their context."""
    param = model.pos_emb.weight  # the dtype it computes in (an int8 model's matrices are int8)
    config, length = model.config, max(len(c) for c, _ in groups)
    pad = torch.tensor([length - len(c) for c, _ in groups])
    idx = torch.zeros(len(groups), length, dtype=torch.long)
    for r, (ctx, _) in enumerate(groups):
        idx[r, length - len(ctx):] = torch.tensor(ctx)
    one = KVCache(config, len(groups), length, param.dtype, param.device, pad)
    last = logits(model, idx.to(param.device), cache=one, keep=1)  # each context's prediction of its first token
    owner = [g for g, (_, conts) in enumerate(groups) for _ in conts]
    conts = [k for _, ks in groups for k in ks]
    judged = [None] * len(conts)
    longest_first = sorted(range(len(conts)), key=lambda r: -len(conts[r]))
    for _, rows in _batches(longest_first, lambda b: (len(b) * len(conts[b[0]]), sum(len(conts[r]) for r in b)),
                            TOKENS_PER_BATCH):
        width = len(conts[rows[0]]) - 1  # what a continuation reads after its context: all but its last token
        out = None
        if width:
            of = torch.tensor([owner[r] for r in rows])
            cache = KVCache(config, len(rows), length + width, param.dtype, param.device, pad[of])
            cache.k[:, :, :, :length] = one.k.index_select(1, of.to(param.device))  # one copy per continuation
            cache.v[:, :, :, :length] = one.v.index_select(1, of.to(param.device))
            idx = torch.zeros(len(rows), width, dtype=torch.long)
            for n, r in enumerate(rows):
                idx[n, : len(conts[r]) - 1] = torch.tensor(conts[r][:-1])
            out = logits(model, idx.to(param.device), cache=cache, pos=length)
        for n, r in enumerate(rows):
            first = last[owner[r]]
            judged[r] = _judge(first if out is None else torch.cat([first, out[n, : len(conts[r]) - 1]]), conts[r])
    found, r = [], 0
    for _, ks in groups:
        found.append(judged[r : r + len(ks)])
        r += len(ks)
    return found


def _judge(rows: torch.Tensor, cont: list[int]) -> tuple[float, bool, int]:
    """(summed log-likelihood of `cont`, whether it is the greedy continuation, its length in tokens)."""
    lp = torch.log_softmax(rows.float(), dim=-1)
    target = torch.tensor(cont, device=lp.device)
    ll = lp.gather(1, target[:, None]).double().sum().item()
    return ll, bool((lp.argmax(-1) == target).all()), len(cont)


def lambada_figures(results: list[list[tuple]]) -> dict:
    """The harness's lambada_openai: accuracy = greedy, perplexity = exp(-mean summed log-likelihood)."""
    import math

    lls = [r[0][0] for r in results]
    return {"examples": len(lls), "accuracy": sum(r[0][1] for r in results) / len(lls),
            "perplexity": math.exp(-sum(lls) / len(lls))}


def choice_figures(pairs: list[Pair], results: list[list[tuple]]) -> dict:
    """acc: the most likely continuation is the label; acc_norm: the same after dividing each log-likelihood by
    the pair's norms (the harness: characters of the ending) or, without norms (nanoGPT), by its token count."""
    acc = acc_norm = 0
    for pair, res in zip(pairs, results):
        lls = [ll for ll, _, _ in res]
        norms = pair.norms or [float(n) for _, _, n in res]
        acc += max(range(len(lls)), key=lambda j: (lls[j], -j)) == pair.label
        acc_norm += max(range(len(lls)), key=lambda j: (lls[j] / norms[j], -j)) == pair.label
    return {"examples": len(pairs), "acc": acc / len(pairs), "acc_norm": acc_norm / len(pairs)}
