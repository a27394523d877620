"""`gpt2port generate --prompts FILE`: every prompt of a file continued in batches (left-padded, each row computing
what it would alone), one JSON line per prompt on stdout, the rate on stderr."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

import gpt2port.generate as decoding
from gpt2port import inputs, jsonio
from gpt2port.errors import GPT2PortError
from gpt2port.generate import Options
from gpt2port.generate_command import load, non_finite, prompt_ids
from gpt2port.tokenizer import StreamDecoder

BATCH = 16  # prompts decoded together: the KV cache grows with it (16 x 1024 positions of 124M: 0.6 GB in fp32)


def read_prompts(path) -> list[str]:
    """The prompts of a file: one a line (blank lines skipped), or for a .jsonl file one object a line with a
    "prompt" string. Refusals name the file and the line."""
    path = Path(path)
    try:
        text = inputs.read_bytes(path, inputs.LIMITS["prompts"], "a file of prompts").decode("utf-8")
    except GPT2PortError as e:  # the gate's refusal, named as the option's
        raise GPT2PortError(f"--prompts {e}") from None
    except UnicodeDecodeError as e:
        raise GPT2PortError(f"--prompts {path}: not UTF-8 (invalid byte at offset {e.start})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if path.suffix != ".jsonl":
        prompts = [line for _, line in lines]
    else:
        prompts = []
        for n, line in lines:
            row = jsonio.loads(line, f"--prompts {path}, line {n}")
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise GPT2PortError(f"--prompts {path}, line {n}: expected an object with a \"prompt\" string")
            prompts.append(row["prompt"])
    if not prompts:
        raise GPT2PortError(f"--prompts {path}: holds no prompt")
    return prompts


def run_batch(ckpt, path, options: Options, dtype: str | None, device: str | None, stop=()) -> None:
    prompts = read_prompts(path)
    tokenizer, model, device = load(ckpt, options, dtype, device)
    rows = [prompt_ids(tokenizer, model, p, f"prompt {i + 1}")[0] for i, p in enumerate(prompts)]
    start, made = time.perf_counter(), 0
    for first in range(0, len(rows), BATCH):
        chunk = rows[first:first + BATCH]
        texts, counts = _continue(model, tokenizer, chunk, options, stop, ckpt)
        made += sum(counts)
        for prompt, text, n in zip(prompts[first:first + BATCH], texts, counts):
            click.echo(json.dumps({"prompt": prompt, "text": text, "tokens": n}, ensure_ascii=False))
    seconds = time.perf_counter() - start
    click.echo(f"{len(rows)} prompts, {made} new tokens in {seconds:.2f} s ({made / seconds:.1f} tokens/s, "
               f"{device}, batches of up to {BATCH})", err=True)


def _continue(model, tokenizer, rows, options: Options, stop, ckpt) -> tuple[list[str], list[int]]:
    """Each row's continuation (ended before a stop string) and its count of new tokens; the batch ends as soon as
    every row has stopped."""
    decoders = [StreamDecoder(tokenizer, stop) for _ in rows]
    texts: list[list[str]] = [[] for _ in rows]
    counts, ended = [0] * len(rows), [False] * len(rows)
    steps = decoding.steps(model, rows, options=options)
    try:
        for step in steps:
            for i, token in enumerate(step.tolist()):
                if ended[i] or token == options.stop_token:
                    ended[i] = True
                    continue
                counts[i] += 1
                texts[i].append(decoders[i].push([token]))
                ended[i] = decoders[i].stopped
            if all(ended):
                break
    except decoding.NonFiniteLogits as e:
        raise non_finite(e, ckpt, model) from None
    finally:
        steps.close()
    return ["".join(t) + d.flush() for t, d in zip(texts, decoders)], counts
