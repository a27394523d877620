"""The command line's LoRA parts, torch-free (imported by cli.py for --help): finetune's --lora options and the
`merge` command, registered on cli.py's group with its error handling (passed in: no import of cli here)."""

from __future__ import annotations

import click

LORA_OPTIONS = (
    click.option("--lora", type=int, default=None, metavar="RANK", help="LoRA of this rank: the base frozen, "
                 "low-rank adapters trained; the run also leaves adapter/ (peft's format) beside the merged "
                 "checkpoint."),
    click.option("--lora-alpha", type=float, default=None, help="LoRA's scaling is alpha / rank (default alpha: the "
                 "rank)."),
    click.option("--lora-targets", default="qkv", show_default=True, help="Comma-separated, of qkv, attn_proj, fc, "
                 "mlp_proj: the matrices of each block that get adapters."),
    click.option("--lora-split-qkv", is_flag=True, help="q, k and v each their own A and B (else one A shared by "
                 "the fused matrix, as peft's c_attn adapter)."),
    click.option("--lora-dropout", type=float, default=0.0, show_default=True, help="Dropout on the adapters' input."),
    click.option("--lora-base-dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
                 help="Hold the frozen base's matrices in bf16: half their memory, products still in fp32 (the "
                 "model trained is the base rounded to bf16; the adapter is merged into the fp32 checkpoint)."),
)


def lora_options(fn):
    for option in reversed(LORA_OPTIONS):
        fn = option(fn)
    return fn


def register(main: click.Group, handle_errors, succeeded) -> None:
    """Add `merge` to the group `main`; handle_errors and succeeded are cli.py's."""

    @main.command()
    @click.argument("base")
    @click.argument("adapter", type=click.Path(path_type=str))
    @click.option("--out", required=True, type=click.Path(path_type=str), help="Output checkpoint directory.")
    @click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default=None,
                  help="Output dtype (default: fp32).")
    @click.option("--force", is_flag=True, help="Replace an existing checkpoint at --out.")
    @handle_errors
    def merge(base, adapter, out, dtype, force):
        """Merge a peft LoRA ADAPTER directory (from `finetune --lora`, or peft's save_pretrained on a
        GPT2LMHeadModel; c_attn, c_proj and c_fc adapters) into the checkpoint BASE: an ordinary checkpoint, its
        logits checked against base + adapter before it is written."""
        from gpt2port.lora.merge import merge as run_merge

        done, diff = run_merge(base, adapter, out, force=force, dtype=dtype)
        succeeded(f"wrote {done} (merged checkpoint; logits against base + adapter: {diff:.1e} relative)")


def export_adapter(ckpt, out, to, dtype, force, other_options: bool) -> str:
    """`gpt2port export ADAPTER --to gguf`: the result line."""
    if to != "gguf" or other_options:
        raise click.UsageError(f"{ckpt} is a LoRA adapter: it exports --to gguf alone (`gpt2port merge` makes a "
                               f"checkpoint of it)")
    from gpt2port.lora.gguf import export_adapter as run

    done, size = run(ckpt, out, dtype=dtype, force=force)
    return f"wrote {done} (llama.cpp LoRA adapter GGUF, {dtype or 'fp32'}, {size / 1e6:.2f} MB)"
