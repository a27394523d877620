"""Sampling from a GPT over its KV cache: the prompt is run once (prefill), then each step feeds only the newest token.

    from gpt2port import GPT, load_tokenizer
    from gpt2port.generate import generate, stream
    model, tok = GPT.from_pretrained("checkpoints/gpt2"), load_tokenizer("checkpoints/gpt2")
    for t in stream(model, tok.encode("The dog"), max_new_tokens=50, temperature=0.8, top_k=200, seed=0): ...
    rows = generate(model, [tok.encode("The dog"), tok.encode("Once upon a time")], max_new_tokens=20, temperature=0)

Choices, each a question a user would ask:
- temperature 0 is greedy decoding (argmax), never a division by zero. top_k is clamped to the vocabulary;
  top_p keeps the smallest set of most likely tokens whose probability reaches p (always at least one token).
- Logits holding NaN or +Inf (NaN weights, an fp16 overflow) are refused (NonFiniteLogits), never sampled from;
  -Inf alone rules a token out.
- A seed makes sampling reproducible on a given device: it seeds a private torch.Generator, so it neither reads
  nor disturbs torch's global random state.
- repetition_penalty is HF's (RepetitionPenaltyLogitsProcessor, CTRL's): each token the row has seen (its prompt
  and what it generated) has its logit divided by the penalty where positive, multiplied where negative, before
  temperature and top-k/top-p.
- Generation stops at <|endoftext|> (not returned) or after max_new_tokens; a batch runs until every row stopped.
- Batches of prompts of different lengths are left-padded. GPT-2's position embeddings are absolute, so each row's
  positions count from its own first token and its padding is hidden from attention: every row gets the tokens it
  would get alone (what HF does with an attention_mask).
- Context beyond n_positions (1024) slides: the model sees at most the newest n_positions tokens (a longer prompt
  is cut to them), and when a row fills the context its newest `keep` tokens (default n_positions // 2) are
  prefilled again and decoding continues from there: one long prefill every n_positions - keep tokens instead of
  one per token. keep=n_positions re-runs the full window every step (nanoGPT's crop). In a batch each row slides
  when it alone would, so its tokens do not depend on its neighbours.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from gpt2port.errors import GPT2PortError
from gpt2port.fast import Settings
from gpt2port.fast.cache import new_cache
from gpt2port.fast.graph import decode_step
from gpt2port.fast.kernels import accelerated
from gpt2port.model import GPT
from gpt2port.tokenizer import ENDOFTEXT_ID


class NonFiniteLogits(GPT2PortError):
    """The logits to choose a token from hold NaN or Inf (NaN/Inf weights, or an overflow in fp16)."""


@dataclass(frozen=True)
class Options:
    """How to generate, declared once: every function here takes an Options, and any field as a keyword besides
    (`generate(model, prompts, 20, temperature=0)`). fast: the accelerations to use (None: Settings.from_env();
    gpt2port.fast.OFF: the model's forward on PyTorch's kernels alone); threads: CPU threads while it runs (None:
    torch's setting as it stands)."""

    max_new_tokens: int = 100
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token: int | None = ENDOFTEXT_ID
    keep: int | None = None
    repetition_penalty: float | None = None
    fast: Settings | None = None
    threads: int | None = None

    @classmethod
    def of(cls, options: "Options | None", max_new_tokens: int | None, fields: dict) -> "Options":
        """`options` (default: the defaults) with max_new_tokens, where given, and `fields` replaced."""
        if max_new_tokens is not None:
            fields = {**fields, "max_new_tokens": max_new_tokens}
        return dataclasses.replace(options or cls(), **fields)


def generate(model: GPT, prompts: Sequence[Sequence[int]] | torch.Tensor, max_new_tokens: int | None = None,
             options: Options | None = None, report: list[str] | None = None, **fields) -> list[list[int]]:
    """New tokens for each prompt (a list of token-id lists, or a (B, T) tensor), without the prompt or stop token.
    report, a list: how the decode steps ran is appended to it."""
    options = Options.of(options, max_new_tokens, fields)
    out: list[list[int]] = [[] for _ in range(len(prompts))]
    stopped = [False] * len(out)
    for step in steps(model, prompts, options=options, report=report):
        for row, token in enumerate(step.tolist()):
            stopped[row] = stopped[row] or token == options.stop_token
            if not stopped[row]:
                out[row].append(token)
    return out


def stream(model: GPT, prompt: Sequence[int], max_new_tokens: int | None = None, options: Options | None = None,
           report: list[str] | None = None, **fields) -> Iterator[int]:
    """Yield the new tokens of one prompt as they are produced (the stop token ends the stream, unyielded)."""
    options = Options.of(options, max_new_tokens, fields)
    for step in steps(model, [prompt], options=options, report=report):
        token = int(step[0])
        if token == options.stop_token:
            return
        yield token


def steps(model: GPT, prompts, max_new_tokens: int | None = None, options: Options | None = None,
          report: list[str] | None = None, **fields) -> Iterator[torch.Tensor]:
    """Yields a (B,) tensor of next tokens per step; rows that have stopped repeat stop_token."""
    for nxt, _ in decode(model, prompts, max_new_tokens, options, report, **fields):
        yield nxt


@torch.inference_mode()
def decode(model: GPT, prompts, max_new_tokens: int | None = None, options: Options | None = None,
           report: list[str] | None = None, check_finite: bool = True, **fields,
           ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The decoding loop: yields (next tokens (B,), the (B, vocab) logits they were drawn from) per step.
    check_finite=False lets greedy decoding go on over NaN/Inf logits, as argmax takes them (verify judges such a
    model, not refuses)."""
    options = Options.of(options, max_new_tokens, fields)
    fast = options.fast or Settings.from_env()
    with cpu_threads(options.threads), accelerated(model, fast) as model:
        yield from _decode(model, prompts, options, fast, report, check_finite)


THREADS_PER_CORE = 4  # --threads beyond this many per core is refused: more only wait for each other


def check_threads(threads: int | None) -> None:
    """A --threads the machine can start (OpenMP may die starting many more than the cores: a signal)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if threads is not None and threads > THREADS_PER_CORE * cores:
        raise GPT2PortError(f"--threads {threads}: at most {THREADS_PER_CORE * cores} on this machine "
                            f"({THREADS_PER_CORE} per core, {cores} cores); threads beyond the cores only wait")


@contextlib.contextmanager
def cpu_threads(n: int | None):
    """torch's intra-op threads set to n for the duration (None: unchanged). On a machine busy with other work, a
    team of threads waits at every operation for its slowest member: fewer threads can decode several times faster."""
    if n is None:
        yield
        return
    if n < 1:
        raise GPT2PortError(f"threads={n} must be at least 1")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _decode(model: GPT, prompts, options: Options, fast: Settings, report: list[str] | None,
            check_finite: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    o = options
    check_sampling(o.temperature, o.top_k, o.top_p)
    if o.repetition_penalty is not None and not o.repetition_penalty > 0:
        raise GPT2PortError(f"repetition_penalty={o.repetition_penalty} must be a number above 0 (1 means off)")
    # The dtype and device the model computes in: the position table's (an int8 model's matrices are int8, its
    # position table and activations fp32).
    param = model.pos_emb.weight
    n_ctx = model.config.n_positions
    keep = n_ctx // 2 if o.keep is None else o.keep
    if not 1 <= keep <= n_ctx:
        raise GPT2PortError(f"keep={keep} must be between 1 and the context length {n_ctx}")
    rows = _prompt_rows(prompts, model.config.vocab_size, o.stop_token)
    if o.max_new_tokens <= 0:
        return
    generator = torch.Generator(param.device).manual_seed(o.seed) if o.seed is not None else None
    tokens, pad = _left_pad([row[-n_ctx:] for row in rows], param.device)
    B = tokens.size(0)
    seen = None  # (B, vocab) the tokens each row has seen, for the repetition penalty: the whole prompt, not the window
    if o.repetition_penalty not in (None, 1.0):
        seen = torch.zeros(B, model.config.vocab_size, dtype=torch.bool, device=param.device)
        for i, row in enumerate(rows):
            seen[i, row] = True
    # Room for exactly what this call can use: a short generation never allocates the whole context. A compiled
    # step is compiled for the cache's shape: there, the whole context, so that one compile serves every length.
    length = n_ctx if fast.compile else min(n_ctx, tokens.size(1) + o.max_new_tokens)
    cache, attention = new_cache(model.config, B, length, param.dtype, param.device, pad, fast)
    logits, _ = model(tokens, cache=cache, logits_to_keep=1)
    step_one = decode_step(model, cache, fast, attention)  # the model's forward, one new token per row
    try:
        yield from _loop(model, tokens, pad, logits, cache, step_one, o, keep, generator, check_finite, seen)
    finally:
        if report is not None:  # after the steps ran: a CUDA graph that failed its check says so
            report.append(step_one.description)


def _loop(model: GPT, tokens: torch.Tensor, pad: torch.Tensor, logits: torch.Tensor, cache, step_one, o: Options,
          keep: int, generator, check_finite: bool, seen: torch.Tensor | None = None,
          ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    B, n_ctx, pos = tokens.size(0), model.config.n_positions, tokens.size(1)
    done = torch.zeros(B, dtype=torch.bool, device=tokens.device)
    for step in range(o.max_new_tokens):
        last = logits[:, -1] if seen is None else penalize(logits[:, -1], seen, o.repetition_penalty)
        nxt = sample(last, o.temperature, o.top_k, o.top_p, generator, check_finite)
        if o.stop_token is not None:
            nxt = nxt.masked_fill(done, o.stop_token)
            done |= nxt == o.stop_token
        if seen is not None:
            seen[torch.arange(B, device=seen.device), nxt] = True
        yield nxt, last
        if step == o.max_new_tokens - 1 or bool(done.all()):
            return
        tokens = torch.cat([tokens, nxt.view(B, 1)], dim=1)
        if pos < cache.max_len:
            logits = step_one(tokens[:, -1:], pos)
            pos += 1
        else:  # the context is full: slide the window and prefill it again
            tokens, pad = _slide(tokens, pad, n_ctx, keep)
            cache.reset(pad)
            logits, _ = model(tokens, cache=cache, logits_to_keep=1)
            pos = tokens.size(1)


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's repetition penalty on (B, V) logits (in fp32, as HF's generate computes its scores): a seen token's
    logit divided by the penalty where positive, multiplied where negative."""
    logits = logits.float()
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None, check_finite: bool = True) -> torch.Tensor:
    """(B, V) logits -> (B,) next tokens. temperature 0 (or None) is greedy; top_k 0/None and top_p None/1 are off."""
    if not temperature:
        # On the CPU PyTorch's argmax over bf16/fp16 takes several times as long as widening to fp32 and taking it
        # there (~2% of a bf16 124M step saved); widening is exact, so the index is the same.
        chosen = (logits.float() if logits.device.type == "cpu" else logits).argmax(dim=-1)
        # argmax takes NaN (and +Inf) as the largest, and a row of -Inf yields its first: the chosen logit alone
        # tells whether the row was finite, at no cost.
        if check_finite and not bool(torch.isfinite(logits.gather(-1, chosen[:, None])).all()):
            raise NonFiniteLogits("the model's logits are NaN or Inf: no token can be chosen from them")
        return chosen
    logits = logits.float()  # fp16/bf16 logits: softmax and cumsum want fp32
    # A finite sum (the common case, one cheap pass) clears the row; otherwise the exact check decides. -Inf rules a
    # token out (a caller's mask); NaN, +Inf or a row with every token ruled out leave nothing to sample from.
    if not bool(torch.isfinite(logits.sum())) and bool(
            (logits.isnan() | (logits == float("inf"))).any() or (logits == float("-inf")).all(dim=-1).any()):
        raise NonFiniteLogits("the model's logits are NaN or Inf: no token can be sampled from them")
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach p; the first never is (its mass before is 0).
        drop = probs.cumsum(dim=-1) - probs > top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).view(-1)


def check_sampling(temperature: float | None, top_k: int | None, top_p: float | None) -> None:
    if temperature is not None and temperature < 0:
        raise GPT2PortError(f"temperature={temperature} must be >= 0 (0 means greedy)")
    if top_k is not None and top_k < 0:
        raise GPT2PortError(f"top_k={top_k} must be >= 0 (0 means off)")
    if top_p is not None and not 0.0 <= top_p <= 1.0:
        raise GPT2PortError(f"top_p={top_p} must be between 0 and 1")


def _prompt_rows(prompts, vocab_size: int, stop_token: int | None) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise GPT2PortError(f"prompts tensor must be (batch, tokens), got shape {tuple(prompts.shape)}")
        prompts = prompts.tolist()
    if len(prompts) == 0:
        raise GPT2PortError("no prompts given")
    rows = []
    for row in prompts:
        row = [int(t) for t in row]
        if not row:  # GPT-2 was trained with <|endoftext|> before each document: an unconditional start
            if stop_token is None:
                raise GPT2PortError("empty prompt and no stop token to start from")
            row = [stop_token]
        bad = [t for t in row if not 0 <= t < vocab_size]
        if bad:
            raise GPT2PortError(f"prompt token id {bad[0]} is outside the model's vocabulary (0..{vocab_size - 1})")
        rows.append(row)
    return rows


def _left_pad(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of token ids -> a (B, L) tensor, left-padded, and the (B,) count of padding positions of each row."""
    L = max(len(r) for r in rows)
    # The padding id is never seen by a real query; 0 is simply a valid row of the embedding.
    tokens = torch.tensor([[0] * (L - len(r)) + r for r in rows], dtype=torch.long, device=device)
    pad = torch.tensor([L - len(r) for r in rows], dtype=torch.long, device=device)
    return tokens, pad


def _slide(tokens: torch.Tensor, pad: torch.Tensor, n_ctx: int, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's next window, each row as it would be alone: a row that outgrew the context (n_ctx + 1 tokens)
    keeps its newest `keep`; a shorter row (it was left-padded) keeps every token it has."""
    rows = [row[p:].tolist() for row, p in zip(tokens, pad.tolist())]
    return _left_pad([row[-keep:] if len(row) > n_ctx else row for row in rows], tokens.device)
