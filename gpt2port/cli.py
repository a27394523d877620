"""The `gpt2port` command line. Thin: parse, call one function, print, exit code.

Every failure is one line on stderr naming the path, key or repo at fault, and a non-zero exit; --debug shows the
traceback. Modules are imported inside the commands so `gpt2port --help` stays fast and never imports transformers.
"""

from __future__ import annotations

import functools
import gc
import os
import sys

import click

from gpt2port.targets import ENCODINGS, TARGETS
from gpt2port.errors import GPT2PortError, allocation_failed, one_line
from gpt2port.evaluation.options import eval_options
from gpt2port.generate_options import generate_options, run as run_generate
from gpt2port.lora import commands as lora
from gpt2port.usage import OneLineUsageGroup
from gpt2port.signals import EXIT_TERMINATED, Terminated, command, program_end, program_start, sigterm_as_interrupt

DTYPE_CHOICE = click.Choice(["fp32", "fp16", "bf16"])
EXPORT_CHOICE = click.Choice([*DTYPE_CHOICE.choices, *sorted({e for t in ENCODINGS.values() for e in t})])
COMPUTE_CHOICE = click.Choice([*DTYPE_CHOICE.choices, "int8"])  # int8: matrices quantized at load (gpt2port.quant)
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130
DONE = "gpt2port.done"  # the exit code, set in the context's meta once a command's work is done (_succeeded)


def _succeeded(text: str, code: int = 0) -> int:
    """A command's result line(s), the last thing it prints: an interrupt arriving from here on finds the work done
    and exits with `code`, as the command would have."""
    click.get_current_context().meta[DONE] = code
    click.echo(text)
    return code


def _handle_errors(fn):
    """Turn every failure into one line on stderr and an exit code (tracebacks only with --debug).

    GPT2PortError and OSError are expected failures; anything else is a bug, but the user still gets one line
    (saying so) rather than a traceback. click's own exceptions pass through: click reports those itself.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        ctx = click.get_current_context()
        debug = ctx.find_root().params.get("debug", False)
        try:
            with sigterm_as_interrupt(), command("torch"):  # torch loaded with Ctrl-C held (gpt2port.signals)
                return fn(*args, **kwargs)
        except (click.exceptions.ClickException, click.exceptions.Abort, click.exceptions.Exit):
            raise
        except (GPT2PortError, OSError) as e:
            if debug:
                raise
            click.echo(f"error: {one_line(e)}", err=True)
            sys.exit(EXIT_FAILURE)
        except KeyboardInterrupt as e:
            if DONE in ctx.meta:  # the result is (being) printed: the work is done
                sys.exit(ctx.meta[DONE])
            if debug:
                raise
            # A Ctrl-C during the final renames is held until they are done, so the output may be complete
            # (or absent); either way nothing partial was left.
            what = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
            click.echo(f"error: {what}; no partial output was left", err=True)
            sys.exit(EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED)
        except Exception as e:  # the last line of defence of the one-line promise
            if debug:
                raise
            if isinstance(e, MemoryError) or allocation_failed(e):  # PyTorch's is a RuntimeError
                from gpt2port.outfile import out_of_memory_line
                click.echo(f"error: {out_of_memory_line(ctx.info_name)}", err=True)
                sys.exit(EXIT_FAILURE)
            click.echo(f"error: internal error: {type(e).__name__}: {one_line(e)} (run with --debug for the "
                       f"traceback, and please report it)", err=True)
            sys.exit(EXIT_FAILURE)

    return wrapper


@click.group(cls=OneLineUsageGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.version_option(package_name="gpt2port")
def main(debug: bool) -> None:
    """Convert, verify and run GPT-2 checkpoints in a from-scratch PyTorch model."""


def run() -> None:
    """The `gpt2port` program: main(), then a quick exit (gc.freeze: the exit's walk of torch's objects skipped,
    docs/performance.md). Ctrl-C and SIGTERM are held until the command has loaded torch and from the end of its
    work (signals.py). Tests call main() itself."""
    program_start()
    try:
        main()
    except SystemExit as e:
        training = sys.modules.get("gpt2port.training.dist")
        if training is not None:  # a rank of torchrun leaves at once (exit_rank says why); else this returns
            training.exit_rank(e.code)
        raise
    finally:
        program_end()
        gc.freeze()


@main.command()
@click.argument("src", type=click.Path(path_type=str))
@click.option("--out", required=True, type=click.Path(path_type=str), help="Output checkpoint directory.")
@click.option("--dtype", type=DTYPE_CHOICE, default=None, help="Output dtype (default: the source's).")
@click.option("--force", is_flag=True, help="Replace an existing checkpoint at --out.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@_handle_errors
def convert(src, out, dtype, force, quiet):
    """Convert a local Hugging Face GPT-2 checkpoint (repo directory or weights file) to gpt2port's layout."""
    from gpt2port.conversion import convert as run_convert
    from gpt2port.progress import byte_progress

    with byte_progress("converting", quiet) as progress:
        result = run_convert(src, out, dtype=dtype, force=force, progress=progress)
    for w in result.warnings:
        click.echo(f"warning: {w}", err=True)
    stored = f" dequantized from {result.dequantized}" if result.dequantized else ""
    _succeeded(f"wrote {result.out} ({result.n_params:,} parameters, {_dtype_label(result.dtype)}{stored}, "
               f"{result.bytes_written / 1e9:.2f} GB) in {result.seconds:.1f}s")


@main.command()
@click.argument("ckpt")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_handle_errors
def info(ckpt, as_json):
    """Config, dtype, size, provenance and a parameter ledger of a converted checkpoint."""
    from gpt2port.info import checkpoint_info, format_info

    facts = checkpoint_info(ckpt)
    if as_json:
        import json

        click.echo(json.dumps(facts, indent=2))
    else:
        click.echo(format_info(facts))


@main.command()
@click.argument("ckpt")
@click.option("--out", required=True, type=click.Path(path_type=str), help="Output directory.")
@click.option("--to", "to", type=click.Choice(list(TARGETS)), default="gpt2port", show_default=True,
              help="Layout: gpt2port's own, Hugging Face's (GPT2LMHeadModel.from_pretrained), llm.c's (gpt2_124M.bin; "
                   "fp32 or bf16), llama.cpp's GGUF (model.gguf) or ONNX with a KV cache (model.onnx; fp32 or fp16).")
@click.option("--dtype", type=EXPORT_CHOICE, default=None,
              help="Output dtype (default: the checkpoint's); llama.cpp's q8_0, q6_k, q5_k_m, ... q4_0 for --to gguf "
                   "only, byte for byte what its llama-quantize writes.")
@click.option("--gguf-output-tensor", is_flag=True,
              help="GGUF: also write the tied head as output.weight (for llama.cpp builds that require it).")
@click.option("--force", is_flag=True, help="Replace an existing directory at --out.")
@click.option("--debug-state", is_flag=True,
              help="With --to llmc: also write gpt2_124M_debug_state.bin (a batch of text, logits, loss and every "
                   "gradient from gpt2port's model), what llm.c's test_gpt2 checks its C code against.")
@_handle_errors
def export(ckpt, out, to, dtype, gguf_output_tensor, force, debug_state):
    """Re-export a converted checkpoint: another dtype, the Hugging Face layout, llm.c's files, llama.cpp's GGUF or
    ONNX; a LoRA adapter directory (peft's format): llama.cpp's adapter GGUF (--to gguf)."""
    from gpt2port.conversion import export as run_export

    if os.path.isfile(os.path.join(ckpt, "adapter_config.json")):
        return _succeeded(lora.export_adapter(ckpt, out, to, dtype, force, debug_state or gguf_output_tensor))

    if debug_state and to != "llmc":
        raise click.UsageError("--debug-state goes with --to llmc")
    if gguf_output_tensor and to != "gguf":
        raise click.UsageError("--gguf-output-tensor goes with --to gguf")
    options = {"debug_state": debug_state, "output_tensor": gguf_output_tensor}
    result = run_export(ckpt, out, to=to, dtype=dtype, force=force,
                        options={k: v for k, v in options.items() if v} or None)
    for w in result.warnings:
        click.echo(f"warning: {w}", err=True)
    for key, value in result.proof.items():  # what the target's own runtime computed from the output (--to onnx)
        click.echo(f"proof: {key} {value:.1e}" if isinstance(value, float) else f"proof: {key} {value}")
    _succeeded(f"wrote {result.out} ({to} layout, {dtype or _dtype_label(result.dtype)}, "
               f"{result.bytes_written / 1e9:.2f} GB)")


def _dtype_label(dtype) -> str:
    from gpt2port.dtypes import label
    return label(dtype)


@main.command()
@click.argument("name")
@click.option("--revision", default=None, help="Branch, tag or commit hash on the Hub (default: main).")
@click.option("--out", type=click.Path(path_type=str), default=None,
              help="Output checkpoint directory (default: ./checkpoints/NAME, or $GPT2PORT_CHECKPOINTS/NAME).")
@click.option("--dtype", type=DTYPE_CHOICE, default=None, help="Output dtype (default: the weights' own).")
@click.option("--verify", "run_verify", is_flag=True, help="Run `gpt2port verify` on the result before finishing.")
@click.option("--force", is_flag=True, help="Replace an existing checkpoint at the output directory.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars and a one-line summary.")
@_handle_errors
def download(name, revision, out, dtype, run_verify, force, quiet):
    """Download NAME from the Hugging Face Hub, check every file's hash, and convert it.

    NAME: gpt2, gpt2-medium, gpt2-large, gpt2-xl, an alias (124M, 355M, 774M, 1.5B, small, medium, large, xl, ...), or
    any Hub repo id of a GPT-2 model (e.g. distilbert/distilgpt2). Files go through the Hugging Face cache (HF_HOME,
    HF_HUB_CACHE), so a second download transfers nothing; HF_TOKEN, HF_ENDPOINT and HF_HUB_OFFLINE=1 work as usual.
    """
    from gpt2port.hub import download as run_download
    from gpt2port.hub.download import summary

    log = (lambda s: None) if quiet else (lambda s: click.echo(s, err=True))
    result = run_download(name, revision=revision, out=out, dtype=dtype, force=force, verify=run_verify,
                          quiet=quiet, log=log)
    if quiet:
        state = "up to date" if result.up_to_date else "written"
        _succeeded(f"{result.out} {state} ({result.repo}@{result.commit[:12]})")
    else:
        _succeeded(summary(result))


@main.command()
@click.argument("ckpt")
@click.option("--reference", type=click.Path(path_type=str), default=None,
              help="HF checkpoint to compare with (default: the source recorded in the checkpoint's manifest).")
@click.option("--dtype", type=COMPUTE_CHOICE, default=None,
              help="Compute dtype for ours and HF (default: the checkpoint's); int8: ours quantized at load, "
                   "HF in fp32.")
@click.option("--tokens", type=click.IntRange(min=2), default=None,
              help="Length of the random-id inputs (default: the full context, e.g. 1024); shorter is faster.")
@click.option("--no-hf", "no_hf", is_flag=True, help="Skip transformers; judge against the float64 reference alone.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report on stdout (schema gpt2port.verify/1).")
@click.option("--grads", is_flag=True,
              help="Also compare the loss and every parameter's gradient with transformers' (fp32); with "
                   "--no-hf, with the float64 reference's own.")
@click.option("--quiet", "-q", is_flag=True, help="No progress line; print only the verdict line.")
@_handle_errors
def verify(ckpt, reference, dtype, tokens, no_hf, as_json, grads, quiet):
    """Prove in numbers that CKPT computes what the reference computes; exit 1 on FAIL.

    Runs the converted model, an independent float64 GPT-2 over the original HF files, and (when installed)
    transformers' GPT2LMHeadModel on natural-text prompts and random ids at full context; compares logits, next-token
    distributions, greedy continuations and loss; judges each block alone to name the first one that differs.
    """
    from gpt2port.verification import run_verify

    report = run_verify(ckpt, reference=reference, dtype=dtype, tokens=tokens, progress=not quiet and not as_json,
                        hf=not no_hf, grads=grads)
    if as_json:
        import json

        text = json.dumps(report.to_dict(), indent=2, allow_nan=False)
    else:
        text = report.to_text().splitlines()[-1] if quiet else report.to_text()
    sys.exit(_succeeded(text, 0 if report.passed else EXIT_FAILURE))


@main.command()
@click.argument("factory", metavar="FILE.py:FACTORY")
@click.argument("ckpt", default="gpt2")
@click.option("--reference", default=None, type=click.Path(path_type=str),
              help="Hugging Face directory or checkpoint to verify against (default: CKPT's recorded source where "
                   "it still exists, else CKPT itself).")
@click.option("--tokens", type=click.IntRange(min=2), default=64, show_default=True,
              help="Length of the random-token inputs of the check.")
@click.option("--no-hf", is_flag=True, help="Skip transformers (float64 reference only).")
@click.option("--drop-biases", is_flag=True,
              help="Load into a class without some of GPT-2's biases, and measure what their absence costs.")
@click.option("--crop-positions", is_flag=True,
              help="A class with a shorter context keeps the first rows of GPT-2's position table.")
@click.option("--tie", is_flag=True, help="Make an untied head the token embedding's own Parameter.")
@_handle_errors
def check(factory, ckpt, reference, tokens, no_hf, drop_biases, crop_positions, tie):
    """Build your own GPT class with FACTORY from FILE.py, load CKPT (default: gpt2) into it, and verify it.

    FILE.py is imported and run as Python (its top-level code executes), so check only files you trust.

    Prints how each of its parameters was read as GPT-2, then the verdict: whether its logits match GPT-2's, and if
    not, the first stage that differs and the known mistake that explains it. FACTORY gets a config answering to
    the tutorials' names as keys and attributes (n_embd, emb_dim, embedding_dim, num_heads, n_heads, num_layers,
    context_length, block_size, drop_rate, qkv_bias, ...). Exit code 0 when the class computes GPT-2.
    """
    from gpt2port.userclass.check import run_check

    ok = run_check(factory, ckpt, reference, tokens, not no_hf, click.echo, drop_biases=drop_biases,
                   crop_positions=crop_positions, tie=True if tie else None, progress=True)
    sys.exit(0 if ok else EXIT_FAILURE)


@main.command()
@click.argument("ckpt")
@click.argument("prompt", required=False)
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=0), default=100, show_default=True,
              help="Stop after this many new tokens (or at <|endoftext|>).")
@click.option("--temperature", "-t", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Sampling temperature; 0 is greedy (argmax).")
@click.option("--top-k", type=click.IntRange(min=0), default=50, show_default=True,
              help="Sample only among the k most likely tokens; 0 turns it off.")
@click.option("--top-p", type=click.FloatRange(0, 1), default=None,
              help="Sample only among the most likely tokens whose probability reaches p (nucleus sampling).")
@click.option("--seed", type=int, default=None, help="Make sampling reproducible (sample i uses seed + i).")
@click.option("--num-samples", type=click.IntRange(min=1), default=1, show_default=True,
              help="Independent continuations of the prompt, one after the other.")
@click.option("--dtype", type=click.Choice([*COMPUTE_CHOICE.choices, "int4"]), default=None,  # int4: quant4
              help="Compute dtype (default: the checkpoint's); int8, int4: matrices quantized at load, fast on CPU.")
@click.option("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available, else cpu).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads for decoding (default: torch's, one per core); on a machine busy with other work, "
                   "fewer (even 1) can be several times faster.")
@click.option("--verbose", "-v", is_flag=True, help="Also measure the memory bandwidth and say how close decoding "
                                                    "came to the rate it allows.")
@generate_options
@_handle_errors
def generate(ckpt, prompt, num_samples, dtype, device, verbose, **settings):
    """Continue PROMPT with CKPT, streaming the text as it is produced; PROMPT `-` reads it from stdin (without its
    trailing newline); --prompts FILE continues many, batched, as JSON lines.

    The prompt is echoed, then each sample's continuation; the prefill and decode rates go to stderr. The model sees
    at most its context (1024 tokens): a longer prompt keeps its end (only that is echoed), and a longer generation
    slides its window.
    """
    run_generate(ckpt, prompt, settings, num_samples, dtype, device, verbose)


@main.command("eval")
@eval_options
@_handle_errors
def eval_(ckpt, as_json, model_card, quiet, **settings):
    """Score CKPT (anything convert reads) by perplexity, LAMBADA or HellaSwag, as the published figures were made."""
    from gpt2port.evaluation.run import command_output

    text = command_output(ckpt, settings, as_json, model_card, quiet)
    if text is not None:  # None: a rank of torchrun but the first
        _succeeded(text)


@main.command()
@_handle_errors
def doctor():
    """Build gpt2port's CPU kernels (once per machine) and report what generation will run on here."""
    from gpt2port.fast.doctor import report

    for line in report():
        click.echo(line)


@main.command()
@click.argument("ckpt")
@click.option("--data", required=True, type=click.Path(path_type=str),
              help="A text file, a directory of .txt files, or a .jsonl file with a \"text\" field.")
@click.option("--out", required=True, type=click.Path(path_type=str),
              help="Run directory: the log, the state to resume from, and at the end the fine-tuned checkpoint.")
@click.option("--steps", type=int, default=1000, show_default=True, help="Optimizer steps.")
@click.option("--batch-size", type=int, default=8, show_default=True,
              help="Sequences per optimizer step, over all processes together.")
@click.option("--block-size", type=int, default=None, help="Tokens per sequence (default: the model's context).")
@click.option("--lr", type=float, default=3e-5, show_default=True, help="Peak learning rate.")
@click.option("--min-lr", type=float, default=None, help="Learning rate at the end of the cosine (default lr/10).")
@click.option("--warmup", type=int, default=None, help="Linear warmup steps (default: a tenth of --steps, <= 100).")
@click.option("--weight-decay", type=float, default=0.1, show_default=True, help="AdamW decay, 2-D weights only.")
@click.option("--clip", type=float, default=1.0, show_default=True, help="Gradient norm clipping (0: none).")
@click.option("--grad-accum", type=int, default=1, show_default=True,
              help="Micro-batches per optimizer step (each process's share of the batch split this many ways).")
@click.option("--eval-every", type=int, default=None, help="Steps between held-out evaluations (default: scaled to "
              "the run, at most 10 besides the first; 0: none).")
@click.option("--eval-windows", type=int, default=32, show_default=True, help="Held-out windows per evaluation.")
@click.option("--sample-every", type=int, default=0, help="Print a sample of the model's text every N steps.")
@click.option("--save-every", type=int, default=None, help="Steps between training-state saves (default: with "
              "each evaluation).")
@click.option("--seed", type=int, default=1337, show_default=True)
@click.option("--dtype", type=click.Choice(["auto", "fp32", "bf16"]), default="auto", show_default=True,
              help="Compute precision: auto is bf16 autocast on CUDA and fp32 on CPU (weights stay fp32).")
@click.option("--dropout", type=float, default=0.0, show_default=True)
@click.option("--val-fraction", type=float, default=0.05, show_default=True, help="Share of tokens held out.")
@click.option("--checkpoint-activations", type=int, is_flag=False, flag_value=-1, default=0, metavar="[N]",
              help="Recompute the activations of the first N blocks (bare: every block) in the backward instead of "
              "keeping them: less memory, one more forward through them per step.")
@lora.lora_options
@click.option("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available; torchrun: one GPU "
              "per process).")
@click.option("--fsdp", is_flag=True, help="Under torchrun: shard parameters, gradients and optimizer state over "
              "the processes (FSDP2) instead of replicating them (DDP).")
@click.option("--compile", "compile_model", is_flag=True, help="torch.compile the model.")
@click.option("--resume", is_flag=True, help="Continue the run in --out from its last saved state.")
@click.option("--force", is_flag=True, help="Start over in an existing --out.")
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
@_handle_errors
def finetune(ckpt, data, out, device, fsdp, compile_model, resume, force, quiet, **numbers):
    """Fine-tune a converted checkpoint on text; run under torchrun for several processes (DDP, or --fsdp)."""
    import os

    from gpt2port.devices import check_device
    from gpt2port.training.finetune import Interrupted, Settings, finetune as run_finetune
    from gpt2port.training.report import wrote

    check_device(device)
    ctx = click.get_current_context()
    given = {k for k in numbers if ctx.get_parameter_source(k) == click.core.ParameterSource.COMMANDLINE}
    try:
        result = run_finetune(ckpt, data, out, Settings(**numbers), device=device, fsdp=fsdp, resume=resume,
                              force=force, compile=compile_model, quiet=quiet, given=given)
    except GPT2PortError as e:
        main_rank = os.environ.get("RANK", "0") == "0"  # every rank refuses alike; rank 0 alone says so
        if isinstance(e, Interrupted):
            if main_rank:
                click.echo(f"interrupted: {e}", err=True)
            sys.exit(128 + e.signum if e.signum else EXIT_INTERRUPTED)  # 130 Ctrl-C, 143 SIGTERM
        if not main_rank:
            sys.exit(EXIT_FAILURE)
        raise
    if os.environ.get("RANK", "0") == "0":
        _succeeded(wrote(result))


lora.register(main, _handle_errors, _succeeded)

if __name__ == "__main__":
    main()
