"""Proof by llama.cpp itself: export a checkpoint to GGUF, load it with llama-cpp-python, and compare its tokens and
logits with gpt2port's own tokenizer and GPT.

    python -m scripts.check_gguf_llamacpp CKPT [--dtypes fp32,fp16,bf16,q8_0] [--work DIR]

Prints one line per dtype: whether tokenization agrees, and the max relative logit error (max |a - b| over max |b|,
on every position of the prompt). llama.cpp's CPU GELU goes through an fp16 lookup table, so f32 agrees to ~1e-3,
not 1e-6. Needs llama-cpp-python (not a gpt2port dependency: it builds llama.cpp from source).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from gpt2port import checkpoint, export
from gpt2port.targets.gguf import FILE_NAME
from gpt2port.model import GPT
from scripts import llamacpp

TEXT = ("The quick brown fox jumps over the lazy dog. GGUF carries GPT-2's byte-level BPE: caf\u00e9, \u4e2d\u6587, "
        "emoji \U0001F600, tabs\tand   spaces, numbers 12345.")


def check(ckpt: Path, dtypes: list[str], work: Path, text: str = TEXT) -> dict[str, dict]:
    enc = checkpoint.load_tokenizer(ckpt)
    ours_tokens = enc.encode(text)
    model = GPT.from_pretrained(ckpt, dtype="fp32")
    n_ctx = model.config.n_positions
    ids = ours_tokens[: n_ctx]
    with torch.no_grad():
        ref = model(torch.tensor([ids]))[0][0].float().numpy()  # (T, V)
    results = {}
    for dtype in dtypes:
        out = work / f"gguf-{dtype}"
        export(ckpt, out, to="gguf", dtype=dtype, force=True)
        llm = llamacpp.load(out / FILE_NAME, n_ctx)
        theirs_tokens = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        logits = llamacpp.run(llm, ids)
        err = float(np.abs(logits - ref).max() / np.abs(ref).max())
        results[dtype] = {"tokens_equal": theirs_tokens == ours_tokens, "n_tokens": len(ids),
                          "max_rel_err": err, "argmax_agree": float((logits.argmax(-1) == ref.argmax(-1)).mean())}
        llm.close()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--dtypes", default="fp32,fp16,bf16,q8_0")
    ap.add_argument("--work", type=Path, default=None, help="where the GGUF files go (default: a temporary dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = check(args.ckpt, args.dtypes.split(","), args.work or Path(tmp))
    for dtype, r in results.items():
        print(f"{dtype:5s} tokens_equal={r['tokens_equal']} n_tokens={r['n_tokens']} "
              f"max_rel_err={r['max_rel_err']:.2e} argmax_agree={r['argmax_agree']:.3f}")


if __name__ == "__main__":
    main()
