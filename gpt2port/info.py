"""`gpt2port info`: what a converted checkpoint holds, with a parameter ledger counted from the file itself."""

from __future__ import annotations

import math

from gpt2port.checkpoint import WEIGHTS, check_weights, read_config, read_manifest, resolve
from gpt2port.dtypes import DTYPE_LABELS
from gpt2port.tokenizer import TOKENIZER_FILES, defines_tokenizer

# Ledger rows: (label, parameter-name suffixes within a block or at the top level). One table, read from the file.
BLOCK_ROWS = [
    ("ln1 (LayerNorm)", ("ln1.weight", "ln1.bias")),
    ("attn qkv", ("attn.qkv.weight", "attn.qkv.bias")),
    ("attn proj", ("attn.proj.weight", "attn.proj.bias")),
    ("ln2 (LayerNorm)", ("ln2.weight", "ln2.bias")),
    ("mlp fc", ("mlp.fc.weight", "mlp.fc.bias")),
    ("mlp proj", ("mlp.proj.weight", "mlp.proj.bias")),
]
TOP_ROWS_BEFORE = [("token embedding (wte)", ("tok_emb.weight",)), ("position embedding (wpe)", ("pos_emb.weight",))]
TOP_ROWS_AFTER = [("final LayerNorm", ("final_norm.weight", "final_norm.bias"))]


def checkpoint_info(ckpt) -> dict:
    ckpt_dir = resolve(ckpt)
    config = read_config(ckpt_dir)
    header = check_weights(ckpt_dir / WEIGHTS, config)
    dtypes = sorted({DTYPE_LABELS.get(e.dtype, str(e.dtype)) for e in header.entries.values()})

    ledger = parameter_ledger({name: e.shape for name, e in header.entries.items()}, config.n_layer)
    return {
        "path": str(ckpt_dir),
        "config": config.to_dict(),
        "dtype": "/".join(dtypes),
        "file_bytes": header.file_size,
        "total_params": sum(row["params"] for row in ledger),
        "ledger": ledger,
        "tokenizer": _tokenizer_files(ckpt_dir),
        "manifest": read_manifest(ckpt_dir),
    }


def _tokenizer_files(ckpt_dir) -> list[str] | None:
    """The tokenizer files the checkpoint carries, or None when they do not define a tokenizer."""
    present = [name for name in TOKENIZER_FILES if (ckpt_dir / name).is_file()]
    return present if defines_tokenizer(present) else None


def parameter_ledger(shapes: dict[str, tuple[int, ...]], n_layer: int) -> list[dict]:
    """Rows of (part, params), the way from-scratch GPT write-ups count them by hand; a tied head counts 0
    because it is wte itself."""
    numel = {name: math.prod(shape) for name, shape in shapes.items()}
    ledger = [{"part": label, "params": sum(numel[k] for k in keys)} for label, keys in TOP_ROWS_BEFORE]
    per_block = [{"part": label, "params": sum(numel[f"blocks.0.{k}"] for k in keys)} for label, keys in BLOCK_ROWS]
    block_total = sum(numel[f"blocks.{i}.{k}"] for i in range(n_layer) for _, keys in BLOCK_ROWS for k in keys)
    ledger.append({"part": f"{n_layer} blocks", "params": block_total, "per_block": per_block,
                   "per_block_total": sum(r["params"] for r in per_block)})
    ledger += [{"part": label, "params": sum(numel[k] for k in keys)} for label, keys in TOP_ROWS_AFTER]
    head = numel.get("lm_head.weight")  # present only when the head is untied
    ledger.append({"part": "lm_head (tied to wte)", "params": 0} if head is None else
                  {"part": "lm_head (untied)", "params": head})
    return ledger


def _save_line(save: dict) -> str:
    """One line per time the weights were re-saved from memory: plain saves, and fine-tuning runs with their data."""
    tuned, merged = save.get("finetune"), save.get("merged_adapter")
    if merged:  # gpt2port merge BASE ADAPTER: which adapter these weights hold, as the manifest records it
        return (f"merged      the LoRA adapter {merged.get('path')} ({merged.get('modules', '?')} modules, sha256 "
                f"{str(merged.get('sha256', '?'))[:16]}...) into {save.get('from')}, {save.get('created', '?')}")
    if not tuned:
        return f"saved       from {save.get('from')} ({save.get('dtype', '?')}), {save.get('created', '?')}"
    files = tuned.get("data", [])
    data = files[0]["path"] if len(files) == 1 else f"{len(files)} files"
    loss = tuned.get("final_eval_loss")
    rank = tuned.get("settings", {}).get("lora")
    return (f"fine-tuned  from {save.get('from')} on {data} ({tuned.get('tokens_train', 0):,} tokens), "
            f"{tuned.get('settings', {}).get('steps', '?')} steps" + (f", eval loss {loss:.4f}" if loss else "")
            + (f", LoRA rank {rank} merged (its adapter: adapter/)" if rank else "") + f", {save.get('created', '?')}")


def format_info(facts: dict) -> str:
    c, m = facts["config"], facts["manifest"]
    src = m.get("source", {})
    lines = [
        f"checkpoint  {facts['path']}",
        f"model       {c['n_layer']} layers, {c['n_head']} heads, {c['n_embd']} wide, vocab {c['vocab_size']}, "
        f"context {c['n_positions']}, {c['activation']}",
        f"weights     {facts['dtype']}, {facts['file_bytes'] / 1e9:.3f} GB",
    ]
    if m:
        origin = src.get("repo") and f"{src['repo']}@{src.get('commit', src.get('revision', '?'))}" or src.get("path")
        lines.append(f"source      {origin} ({src.get('dtype', '?')}), converted {m.get('created', '?')} "
                     f"by gpt2port {m.get('version', '?')}")
        for f in src.get("files", []):
            lines.append(f"            {f['name']}  {f['size']:,} bytes  sha256 {f['sha256']}")
        for save in m.get("saves", []):
            lines.append(_save_line(save))
    tok = facts["tokenizer"]
    lines.append(f"tokenizer   {', '.join(tok)}" if tok else
                 "tokenizer   none: loading in Python works; `gpt2port generate` and text prompts do not")
    for w in m.get("warnings", []):
        lines.append(f"warning     {w}")
    lines += ["", f"{'parameters':<34}{'count':>16}"]
    for row in facts["ledger"]:
        lines.append(f"{row['part']:<34}{row['params']:>16,}")
        if "per_block" in row:
            for sub in row["per_block"]:
                lines.append(f"  per block: {sub['part']:<21}{sub['params']:>16,}")
            lines.append(f"  per block: {'total':<21}{row['per_block_total']:>16,}")
    lines.append(f"{'total':<34}{facts['total_params']:>16,}")
    return "\n".join(lines)
