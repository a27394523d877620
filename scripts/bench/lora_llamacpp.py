"""Proof by llama.cpp itself that gpt2port's LoRA adapter GGUF (`gpt2port export ADAPTER --to gguf`) is what it
should be: llama.cpp (llama-cpp-python's lora_path) running the adapter over the base's GGUF computes what llama.cpp
computes on the merged model's GGUF, and what gpt2port computes with the adapter.

    python -m scripts.bench.lora_llamacpp [--work DIR] [--targets qkv,attn_proj,fc,mlp_proj] [--rank 4]
                                          [--alpha 8] [--split-qkv] [--dtype fp32|fp16]

Without a checkpoint named, it runs on a realistic-scale tiny GPT-2 (tests/realistic.py) with a trained-like
adapter (B not zero). Prints the date, the machine's load and one line per comparison (max |a - b| over max |b|, on
every position of a 40-token prompt). Needs llama-cpp-python (not a gpt2port dependency: it builds llama.cpp from
source).
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from scripts import llamacpp

IDS = list(range(100, 140))


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())


def check(ckpt: Path, adapter: Path, work: Path, dtype: str = "fp32") -> dict:
    """Export `ckpt`, the merge of `adapter` into it, and `adapter`, to GGUF under `work`; run them in llama.cpp."""
    from gpt2port import GPT, export
    from gpt2port.lora import layer
    from gpt2port.lora.gguf import FILE_NAME, export_adapter
    from gpt2port.lora.merge import merge
    from gpt2port.lora.peft import read_adapter

    merge(ckpt, adapter, work / "merged")
    export(ckpt, work / "base", to="gguf")
    export(work / "merged", work / "merged-gguf", to="gguf")
    export_adapter(adapter, work / "lora", dtype=dtype)
    model = GPT.from_pretrained(ckpt, dtype=torch.float32)
    layer.attach_deltas(model, read_adapter(adapter)[0])
    with torch.no_grad():
        ours = layer.logits_of(model.eval(), torch.tensor([IDS]))[0].numpy()
    base = llamacpp.logits(work / "base" / "model.gguf", IDS)
    merged = llamacpp.logits(work / "merged-gguf" / "model.gguf", IDS)
    adapted = llamacpp.logits(work / "base" / "model.gguf", IDS, lora_path=str(work / "lora" / FILE_NAME))
    return {"adapter_moves_logits": _rel(base, merged), "adapter_vs_merged": _rel(adapted, merged),
            "adapter_vs_gpt2port": _rel(adapted, ours), "merged_vs_gpt2port": _rel(merged, ours),
            "argmax_agree": float((adapted.argmax(-1) == ours.argmax(-1)).mean())}


def realistic_adapter(work: Path, targets, rank: int, alpha: float, split_qkv: bool) -> tuple[Path, Path]:
    """A realistic-scale tiny checkpoint and a trained-like peft adapter of it (tests/lora/helpers.py's)."""
    from gpt2port.lora import layer
    from gpt2port.lora.peft import write_adapter
    from scripts.hf_fixtures import TINY
    from tests.lora.helpers import lora_model
    from tests.realistic import realistic_checkpoint

    _, ckpt = realistic_checkpoint(work, {**TINY, "n_layer": 3}, seed=7)
    (work / "adapter").mkdir()
    write_adapter(work / "adapter", layer.deltas_of(lora_model(ckpt, targets, rank, alpha, split_qkv)), str(ckpt))
    return ckpt, work / "adapter"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=None, help="where the files go (default: a temporary directory)")
    ap.add_argument("--targets", default="qkv,attn_proj,fc,mlp_proj")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=8.0)
    ap.add_argument("--split-qkv", action="store_true")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "fp16"])
    args = ap.parse_args()
    import llama_cpp

    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        ckpt, adapter = realistic_adapter(work, tuple(args.targets.split(",")), args.rank, args.alpha, args.split_qkv)
        load = os.getloadavg()[0]
        r = check(ckpt, adapter, work, args.dtype)
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, llama-cpp-python "
          f"{llama_cpp.__version__}, {os.cpu_count()} cores, load average {load:.1f} -> {os.getloadavg()[0]:.1f}; "
          f"realistic-scale tiny GPT-2 (3 layers), adapter rank {args.rank} alpha {args.alpha:g} on {args.targets}"
          f"{' (q, k, v apart)' if args.split_qkv else ''}, {args.dtype}, a {len(IDS)}-token prompt")
    for key in ("adapter_moves_logits", "adapter_vs_merged", "adapter_vs_gpt2port", "merged_vs_gpt2port"):
        print(f"  {key}: {r[key]:.2e} (max relative)")
    print(f"  argmax agreement, llama.cpp + adapter vs gpt2port: {r['argmax_agree']:.3f}")


if __name__ == "__main__":
    main()
