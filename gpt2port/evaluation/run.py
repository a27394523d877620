"""`gpt2port eval`: read and check the data, load the model(s), score, and return the result as a dict (the JSON)."""

from __future__ import annotations

import math
import time
from pathlib import Path

from gpt2port.errors import GPT2PortError
from gpt2port.evaluation import choices, data
from gpt2port.evaluation.load import load, pick_device

TASKS = ("perplexity", "lambada", "hellaswag")
PROTOCOLS = ("harness", "nanogpt")
# Published datasets by name: where each is published, for the line that says to fetch it and pass the file.
PUBLISHED = {
    "wikitext-2": ("perplexity", "wikitext-2-raw-v1's wiki.test.raw (Salesforce/wikitext on the Hugging Face Hub)"),
    "wikitext-103": ("perplexity", "wikitext-103-raw-v1's wiki.test.raw (Salesforce/wikitext on the Hugging Face Hub)"),
    "lambada": ("lambada", "https://openaipublic.blob.core.windows.net/gpt-2/data/lambada_test.jsonl"),
    "hellaswag": ("hellaswag", "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"),
}


def run_eval(ckpt: str, task: str, data_path: str, *, stride: int | None = None, against: str | None = None,
             protocol: str | None = None, dtype: str | None = None, device: str | None = None,
             batch_tokens: int | None = None, progress=None) -> dict:
    """The figures of `task` for the model at `ckpt` on the file at `data_path`, with the settings that made them."""
    if task not in TASKS:
        raise GPT2PortError(f"--task {task}: unknown (known: {', '.join(TASKS)})")
    if against is not None and task != "perplexity":
        raise GPT2PortError("--against goes with --task perplexity")
    if stride is not None and task != "perplexity":
        raise GPT2PortError("--stride goes with --task perplexity")
    if protocol is not None and task != "hellaswag":
        raise GPT2PortError("--protocol goes with --task hellaswag")
    path = _data_file(data_path, task)
    pairs = None  # read and checked before a model loads: a bad line costs no load
    if task == "lambada":
        pairs = data.lambada(path)
    elif task == "hellaswag":
        pairs = data.hellaswag(path, protocol or "harness")
    else:
        text = data.read_text(path)
    device = pick_device(device, dtype)
    t0 = time.perf_counter()
    loaded = load(ckpt, dtype, device)
    result = {"task": task, "model": loaded.name, "dtype": loaded.dtype, "device": device, "data": str(path),
              "dataset": Path(path).name}
    if task == "perplexity":
        from gpt2port.evaluation.windows import TOKENS_PER_BATCH, perplexity

        ids = loaded.tokenizer.encode(text, allowed_special="all")
        if len(ids) < 2:
            raise GPT2PortError(f"{path}: holds {len(ids)} token; perplexity needs at least two")
        base = None
        if against is not None:
            base = load(against, None, device).model  # at its file's dtype: the reference the model is judged by
            result["against"] = against
        result.update(perplexity(loaded.model, ids, text, stride, base, progress, batch_tokens or TOKENS_PER_BATCH))
    else:
        scores = choices.score(loaded.model, loaded.tokenizer, pairs, protocol == "nanogpt", progress,
                               batch_tokens or choices.TOKENS_PER_BATCH)
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
    return result


def _data_file(data_path: str, task: str) -> Path:
    path = Path(data_path)
    if path.exists() or data_path not in PUBLISHED:
        if not path.exists():
            raise GPT2PortError(f"--data {data_path}: no such file (published datasets by name: "
                                f"{', '.join(PUBLISHED)})")
        return path
    kind, where = PUBLISHED[data_path]
    if kind != task:
        raise GPT2PortError(f"--data {data_path}: a {kind} dataset, not one for --task {task}")
    raise GPT2PortError(f"--data {data_path}: this version does not download datasets; fetch {where} and pass "
                        f"--data FILE")


def command_output(ckpt: str, settings: dict, as_json: bool, model_card: bool, quiet: bool) -> str:
    """What the command prints: the table, the JSON or the model card; progress and notes go to stderr."""
    import click

    from gpt2port.evaluation import report
    from gpt2port.progress import StatusLine

    if as_json and model_card:
        raise GPT2PortError("--json and --model-card: choose one")
    progress = StatusLine("eval", quiet, lines=True, tick=1.0)
    result = run_eval(ckpt, settings.pop("task"), settings.pop("data"), progress=progress, **settings)
    progress(None)
    for note in result["notes"]:
        click.echo(f"note: {note}", err=True)
    if as_json:
        return report.as_json(result)
    return report.model_card(result) if model_card else report.table(result)
