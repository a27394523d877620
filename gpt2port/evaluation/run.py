"""`gpt2port eval`: read and check the data, load the model(s), score, and return the result as a dict (the JSON)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from gpt2port.errors import GPT2PortError
from gpt2port.evaluation import choices, data, published
from gpt2port.evaluation.load import load, pick_device
from gpt2port.evaluation.ranks import start

TASKS = ("perplexity", "lambada", "hellaswag")
PROTOCOLS = ("harness", "nanogpt")

def run_eval(ckpt: str, task: str, data_path: str, *, stride: int | None = None, against: str | None = None,
             protocol: str | None = None, dtype: str | None = None, device: str | None = None,
             batch_tokens: int | None = None, progress=None, threads: int | None = None) -> dict:
    """The figures of `task` for the model at `ckpt` on the file at `data_path`, with the settings that made them;
    threads: torch's CPU threads while it runs (None: as they are)."""
    from gpt2port.generate import check_threads, cpu_threads

    check_threads(threads)
    with cpu_threads(threads):
        return _run_eval(ckpt, task, data_path, stride, against, protocol, dtype, device, batch_tokens, progress)


def _run_eval(ckpt, task, data_path, stride, against, protocol, dtype, device, batch_tokens, progress) -> dict:
    if task not in TASKS:
        raise GPT2PortError(f"--task {task}: unknown (known: {', '.join(TASKS)})")
    if against is not None and task != "perplexity":
        raise GPT2PortError("--against goes with --task perplexity")
    if stride is not None and task != "perplexity":
        raise GPT2PortError("--stride goes with --task perplexity")
    if protocol is not None and task != "hellaswag":
        raise GPT2PortError("--protocol goes with --task hellaswag")
    path, fetched = _data_file(data_path, task, progress)
    pairs = None  # read and checked before a model loads: a bad line costs no load
    if task == "lambada":
        pairs = data.lambada(path)
    elif task == "hellaswag":
        pairs = data.hellaswag(path, protocol or "harness")
    else:
        text = data.read_text(path, fetched and fetched.text)
    ranks, device = start(pick_device(device, dtype))
    t0 = time.perf_counter()
    loaded = load(ckpt, dtype, device)
    result = {"task": task, "model": loaded.name, "dtype": loaded.dtype, "device": device, "data": str(path),
              "dataset": Path(path).name}
    if fetched is not None:  # a published dataset by name: where it came from, and the hash it was checked by
        result.update(data=fetched.source, dataset=data_path, data_sha256=fetched.sha256)
    check_batch_tokens(batch_tokens, loaded.model, device, against is not None)
    if task == "perplexity":
        from gpt2port.evaluation.windows import TOKENS_PER_BATCH, perplexity

        ids = loaded.tokenizer.encode(text, allowed_special="all")
        if len(ids) < 2:
            raise GPT2PortError(f"{path}: holds {len(ids)} token; perplexity needs at least two")
        base = None
        if against is not None:
            base = load(against, None, device, "the --against base").model  # at its file's dtype: the reference
            result["against"] = against
        result.update(perplexity(loaded.model, ids, text, stride, base, progress, batch_tokens or TOKENS_PER_BATCH,
                                 ranks))
    else:
        scores = choices.score(loaded.model, loaded.tokenizer, pairs, protocol == "nanogpt", progress,
                               batch_tokens or choices.TOKENS_PER_BATCH, ranks)
        if task == "lambada":
            result.update(choices.lambada_figures(scores))
        else:
            result["protocol"] = protocol or "harness"
            result.update(choices.choice_figures(pairs, scores))
    bad = [k for k, v in result.items() if isinstance(v, float) and math.isnan(v)]
    if bad or not math.isfinite(result.get("nll", 0.0)):
        raise GPT2PortError(f"{ckpt}: its log-likelihoods are not finite ({', '.join(bad) or 'nll'}); an overflow in "
                            f"half precision? try --dtype fp32")
    result["seconds"] = time.perf_counter() - t0
    result["notes"] = loaded.notes
    if ranks.world > 1:
        result["ranks"] = ranks.world
    return result


def check_batch_tokens(batch_tokens: int | None, model, device: str, two: bool = False) -> None:
    """--batch-tokens sized before any batch runs: a batch's logits (and their log-softmax, in fp32) and activations,
    twice with --against, must fit in the device's memory (the CPU's: its physical memory)."""
    if batch_tokens is None:
        return
    import torch

    c = model.config
    per_token = 4 * (2 * c.vocab_size + 16 * c.n_embd) * (2 if two else 1)
    if str(device).startswith("cuda"):
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if batch_tokens * per_token > total:
        need = batch_tokens * per_token / 1e9
        raise GPT2PortError(f"--batch-tokens {batch_tokens}: a batch would need about {need:,.1f} GB ({per_token:,} "
                            f"bytes a token), more than the {total / 1e9:,.1f} GB of {device}; "
                            f"at most {total // per_token:,} fit (default 4096)")


def _data_file(data_path: str, task: str, progress=None) -> tuple[Path, published.Fetched | None]:
    """The file --data names, or the published dataset of that name (fetched, checked, cached)."""
    path = Path(data_path)
    if path.exists() or data_path not in published.NAMES:
        if not path.exists():
            raise GPT2PortError(f"--data {data_path}: no such file (published datasets by name: "
                                f"{', '.join(published.NAMES)})")
        return path, None
    fetched = published.fetch(data_path, task, quiet=not getattr(progress, "enabled", False))
    return fetched.path, fetched


def command_output(ckpt: str, settings: dict, as_json: bool, model_card: bool, quiet: bool) -> str | None:
    """What the command prints: the table, the JSON or the model card (None: a rank of torchrun but the first,
    which prints nothing); progress and notes go to stderr."""
    import click

    from gpt2port.evaluation import report
    from gpt2port.evaluation.ranks import first
    from gpt2port.progress import StatusLine

    if as_json and model_card:
        raise GPT2PortError("--json and --model-card: choose one")
    progress = StatusLine("eval", quiet or not first(), lines=True, tick=1.0)
    try:
        result = run_eval(ckpt, settings.pop("task"), settings.pop("data"), progress=progress, **settings)
    finally:
        progress(None)  # the line cleared and its ticker stopped, on errors too
    if not first():
        return None
    for note in result["notes"]:
        click.echo(f"note: {note}", err=True)
    if as_json:
        return report.as_json(result)
    return report.model_card(result) if model_card else report.table(result)
