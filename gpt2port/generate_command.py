"""`gpt2port generate`: load, stream each sample's text as it comes, time prefill and decode apart, and say what
slowed them. The command line (cli.py) parses; this runs."""

from __future__ import annotations

import dataclasses
import math
import time

import click
import torch

from gpt2port.checkpoint import load_tokenizer
from gpt2port.dtypes import QUANTIZED, label
from gpt2port.devices import check_device
from gpt2port.errors import GPT2PortError
import gpt2port.generate as decoding  # looked up at each run: tests spy on decoding.stream
from gpt2port.generate import NonFiniteLogits, Options, check_threads, cpu_threads
from gpt2port.fast import int4
from gpt2port.tokenizer import StreamDecoder

# The machine is called busy when decoding averaged BUSY_FACTOR times slower than its fastest step (over at least
# BUSY_STEPS steps): on a quiet machine the steps stay within ~1.5x of each other, a growing context included.
BUSY_FACTOR, BUSY_STEPS = 3, 8


def load(ckpt, options: Options, dtype: str | None, device: str | None):
    """(tokenizer, model, device) for a generation with `options`, each setting checked first."""
    threads = options.threads
    # click's ranges let NaN through
    for name, value in (("--temperature", options.temperature), ("--top-p", options.top_p),
                        ("--repetition-penalty", options.repetition_penalty)):
        if value is not None and not math.isfinite(value):
            raise GPT2PortError(f"{name} {value}: must be a finite number")
    check_threads(threads)
    device = device or ("cpu" if dtype in QUANTIZED or not torch.cuda.is_available() else "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GPT2PortError(f"--device {device}: CUDA is not available on this machine")
    check_device(device)
    tokenizer = load_tokenizer(ckpt)
    return tokenizer, int4.from_pretrained(ckpt, dtype=dtype, device=device), device  # GPT's, and int4


def prompt_ids(tokenizer, model, prompt: str, which: str = "the prompt") -> tuple[list[int], str]:
    """(the prompt's tokens the model sees, their text): a typed <|endoftext|> is the document separator, and a
    prompt longer than the context keeps its end, with a note."""
    ids = tokenizer.encode(prompt, allowed_special="all")
    n_ctx = model.config.n_positions
    if len(ids) <= n_ctx:
        return ids, prompt
    click.echo(f"note: {which} has {len(ids)} tokens; the model sees only the last {n_ctx}, and only they are "
               f"shown", err=True)
    return ids[-n_ctx:], tokenizer.decode(ids[-n_ctx:])


def run_generate(ckpt, prompt: str, options: Options, num_samples: int = 1, dtype: str | None = None,
                 device: str | None = None, verbose: bool = False, stop=()) -> None:
    """Sample `num_samples` continuations of `prompt` (sample i with options.seed + i) and report the rates; each
    ends before the first of the `stop` strings."""
    threads = options.threads
    tokenizer, model, device = load(ckpt, options, dtype, device)
    ids, prompt = prompt_ids(tokenizer, model, prompt)  # what is echoed is what the model sees
    # The first token of a sample comes from the prompt's forward pass (and, the first time, one-time warm-up);
    # each later one from one decode step. Their rates differ by orders of magnitude, so they are timed apart.
    prefill_s = decode_s = 0.0
    decoded = 0
    how: list[str] = []  # how the decode steps ran, as generate reports it
    fastest = float("inf")  # the fastest decode step: what this machine gives when nothing else gets in the way
    for i in range(num_samples):
        if i:
            click.echo("-" * 40)
        click.echo(prompt, nl=False)
        text = StreamDecoder(tokenizer, stop)
        start = time.perf_counter()
        first = last = None
        try:
            seed = None if options.seed is None else options.seed + i
            for token in decoding.stream(model, ids, options.max_new_tokens, dataclasses.replace(options, seed=seed),
                                         report=how):
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    decoded += 1
                    fastest = min(fastest, now - last)
                last = now
                click.echo(text.push([token]), nl=False)
                if text.stopped:
                    break
        except BaseException as e:
            click.echo(text.flush())  # an error (or Ctrl-C) goes on a line of its own, after the text so far
            if isinstance(e, NonFiniteLogits):
                raise non_finite(e, ckpt, model) from None
            raise
        end = time.perf_counter()
        click.echo(text.flush())
        prefill_s += (first or end) - start
        decode_s += end - (first or end)
    rate = decoded / decode_s if decode_s > 0 else 0.0
    times = f" x {num_samples} samples" if num_samples > 1 else ""  # each sample prefills the prompt again
    n_threads = torch.get_num_threads() if threads is None else threads
    team = f", {n_threads} thread{'s' if n_threads > 1 else ''}" if device == "cpu" else ""
    click.echo(f"prefill {len(ids) or 1} tokens{times} in {prefill_s:.2f} s; then {decoded} tokens in {decode_s:.2f} "
               f"s: {rate:.1f} tokens/s ({dtype or label(model.pos_emb.weight.dtype)}, {device}{team})", err=True)
    if device == "cpu" and decoded >= BUSY_STEPS and rate * fastest * BUSY_FACTOR < 1:
        advice = "; try --threads 1 (or fewer threads than idle cores)" if n_threads > 1 else ""
        click.echo(f"note: decoding averaged {rate:.1f} tokens/s, but its fastest step ran at {1 / fastest:.1f}: other "
                   f"work on this machine is slowing it down{advice}", err=True)
    if verbose and decoded:
        from gpt2port.fast.speed import decode_report

        with cpu_threads(threads):  # the floor of the threads decoding had
            for line in decode_report(model, device, rate, how[-1] if how else None):
                click.echo(line, err=True)


def non_finite(e: BaseException, ckpt, model) -> BaseException:
    """What to raise for an error while decoding: NaN/Inf logits named with the weights that explain them."""
    return GPT2PortError(f"{ckpt}: {e}{_non_finite_weights(model)}") if isinstance(e, NonFiniteLogits) else e


def _non_finite_weights(model) -> str:
    from gpt2port.verification.diagnose import describe_non_finite, non_finite_parameters

    bad = non_finite_parameters(model)
    if bad:
        return f"; {describe_non_finite(bad, 'its')}"
    half = model.pos_emb.weight.dtype in (torch.float16, torch.bfloat16)
    return " (its weights are finite: an overflow in half precision? try --dtype fp32)" if half else ""
