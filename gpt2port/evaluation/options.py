"""`gpt2port eval`'s options (click only: `gpt2port --help` imports this without torch)."""

from __future__ import annotations

import click

OPTIONS = [
    click.argument("ckpt"),
    click.option("--task", required=True, type=click.Choice(["perplexity", "lambada", "hellaswag"]),
                 help="perplexity: the sliding window over a text; lambada: LAMBADA OpenAI's jsonl; hellaswag: "
                      "HellaSwag's jsonl."),
    click.option("--data", required=True, help="The text (perplexity) or jsonl (lambada, hellaswag) file, or a "
                 "published dataset by name (wikitext-2, wikitext-2-raw, lambada: fetched from the Hub, checked and "
                 "cached)."),
    click.option("--stride", type=int, default=None,
                 help="Perplexity: tokens each window advances (default: half the model's context)."),
    click.option("--against", default=None, help="Perplexity: run BASE (at its own dtype) on the same windows too: "
                                                 "KL(base||model) per token, top-1 agreement, base perplexity."),
    click.option("--protocol", type=click.Choice(["harness", "nanogpt"]), default=None,
                 help="HellaSwag: lm-evaluation-harness's scoring (default), or build-nanogpt/llm.c's."),
    click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16", "int8", "int4"]), default=None,
                 help="Compute dtype (default: the checkpoint's); int8, int4: matrices quantized at load, CPU."),
    click.option("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when available, else cpu)."),
    click.option("--batch-tokens", type=click.IntRange(min=1), default=None,
                 help="Tokens per forward pass (default 4096: four windows of 1024)."),
    click.option("--threads", type=click.IntRange(min=1), default=None,
                 help="CPU threads (default: torch's, one per core); on a machine busy with other work, fewer (even "
                      "1) can be several times faster."),
    click.option("--json", "as_json", is_flag=True, help="Machine-readable output."),
    click.option("--model-card", is_flag=True, help="Print a model-index block for a Hugging Face model card."),
    click.option("--quiet", "-q", is_flag=True, help="No progress on stderr."),
]


def eval_options(fn):
    for option in reversed(OPTIONS):
        fn = option(fn)
    return fn
