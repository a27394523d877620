"""`gpt2port generate`'s options that HF transformers' and llama.cpp's users look for (stop strings, a repetition
penalty, a file of prompts), and the choice between one prompt and a file of them. Click only: `gpt2port --help`
imports this without torch."""

from __future__ import annotations

import sys

import click

OPTIONS = [
    click.option("--stop", multiple=True, metavar="STR",
                 help="End the output before STR and stop generating there (repeatable; HF's stop_strings)."),
    click.option("--repetition-penalty", type=float, default=None, metavar="F",
                 help="HF's repetition penalty: each token already seen (prompt included) has its logit divided by F "
                      "where positive, multiplied where negative; 1 is off, 1.2 a common choice."),
    click.option("--prompts", "prompts_file", type=click.Path(path_type=str), default=None, metavar="FILE",
                 help="Continue every prompt of FILE, batched: one prompt a line, or JSONL (a .jsonl file) with a "
                      "\"prompt\" field; one JSON line per prompt on stdout."),
]


def generate_options(fn):
    for option in reversed(OPTIONS):
        fn = option(fn)
    return fn


def run(ckpt, prompt: str | None, settings: dict, num_samples: int, dtype, device, verbose: bool) -> None:
    """One PROMPT (`-`: stdin) streamed, or a file of them batched. settings: the command's other options, by
    name: the fields of gpt2port.generate.Options, and this module's."""
    fields = dict(settings)
    stop, repetition_penalty, prompts_file = (fields.pop(k) for k in ("stop", "repetition_penalty", "prompts_file"))
    if (prompt is None) == (prompts_file is None):
        raise click.UsageError("give PROMPT or --prompts FILE" + (", not both" if prompt is not None else ""))
    if prompts_file is not None and num_samples > 1:
        raise click.UsageError("--num-samples goes with one PROMPT, not with --prompts")
    from gpt2port.generate import Options

    options = Options(**fields, repetition_penalty=repetition_penalty)
    if prompts_file is not None:
        from gpt2port.generate_batch import run_batch

        return run_batch(ckpt, prompts_file, options, dtype, device, stop)
    from gpt2port.generate_command import run_generate

    run_generate(ckpt, read_prompt(prompt), options, num_samples, dtype, device, verbose, stop)


def read_prompt(prompt: str, stdin=None) -> str:
    """PROMPT, or for `-` stdin without the one trailing newline that `echo` and a file's last line add."""
    if prompt != "-":
        return prompt
    text = (stdin or sys.stdin).read()
    return text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text
