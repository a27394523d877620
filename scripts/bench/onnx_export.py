"""export --to onnx at a real shape: the export's wall time and peak RSS (a fresh process), its own proof, and
onnxruntime's greedy decoding against transformers' logits over the tokens it chose.

    python -m scripts.bench.onnx_export [--size gpt2] [--dtype fp32 fp16] [--work DIR]

The checkpoint is made first, untimed: GPT-2 of --size's shape with realistic-scale random weights
(tests/realistic.py), as an HF repo and its gpt2port conversion. onnxruntime prefills a 12-token prompt from an
empty cache and decodes 8 tokens, one per call with the cache it returned; "rel" is max |onnxruntime - transformers|
/ max |transformers| over every logit (transformers in fp32 over the unrounded weights, for fp16 too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from scripts.bench.export import timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="gpt2")
    ap.add_argument("--dtype", nargs="+", default=["fp32", "fp16"])
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    import onnxruntime
    from transformers import GPT2LMHeadModel

    from gpt2port.targets.onnx import FILE_NAME, greedy
    from tests.realistic import realistic_checkpoint

    work = Path(tempfile.mkdtemp(dir=args.work))
    try:
        hf_dir, ckpt = realistic_checkpoint(work, args.size, seed=7)
        hf = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=torch.float32).eval()
        print(f"{args.size}, realistic-scale random weights; load average {os.getloadavg()[0]:.1f} at the start")
        for dtype in args.dtype:
            out = work / f"onnx-{dtype}"
            wall, rss = timed([sys.executable, "-m", "gpt2port", "export", str(ckpt), "--to", "onnx", "--dtype", dtype,
                               "--out", str(out)])
            proof = json.loads((out / "manifest.json").read_text())["proof"]
            size = sum(f.stat().st_size for f in out.glob(f"{FILE_NAME}*")) / 1e9
            session = onnxruntime.InferenceSession(str(out / FILE_NAME), providers=["CPUExecutionProvider"])
            ids = torch.randint(0, hf.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
            tokens, logits = greedy(session, ids, torch.ones_like(ids), 9)
            with torch.no_grad():
                want = hf(tokens).logits[:, :-1]
            rel = float((logits - want).abs().max() / want.abs().max())
            same = int((logits.argmax(-1) == want.argmax(-1)).sum())
            print(f"{dtype}: export {wall:.1f} s, peak RSS {rss / 1024**2:.2f} GB, graph + weights {size:.2f} GB | "
                  f"proof rel {proof['max_rel_error']:.1e} | vs transformers rel {rel:.1e}, greedy tokens agree "
                  f"{same}/{want.size(1)} | load average {os.getloadavg()[0]:.1f}")
            shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
