"""export --to onnx at a real shape: the export's wall and CPU time and peak RSS (a fresh process; /usr/bin/time), the
peak RSS of each of its steps (scripts/bench/onnx_phases.py), its own proof, and onnxruntime's greedy decoding
against transformers' logits over the tokens it chose.

    python -m scripts.bench.onnx_export [--size gpt2] [--dtype fp32 fp16] [--work DIR] [--root DIR]

The checkpoint is made first, untimed: GPT-2 of --size's shape with realistic-scale random weights
(tests/realistic.py), as an HF repo and its gpt2port conversion; with --root, scripts/bench/generate.py's instead
(random weights written tensor by tensor, kept in --root for the next run: what gpt2-xl's shape needs, where
building the HF model to save it would hold 6 GB more). Run gpt2-xl under `flock /tmp/bigmem.lock`. onnxruntime
prefills a 12-token prompt from an empty cache and decodes 8 tokens, one per call with the cache it returned; "rel"
is max |onnxruntime - transformers| / max |transformers| over every logit (transformers in fp32 over the unrounded
weights, for fp16 too).
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
    ap.add_argument("--rss-limit", type=float, default=19.0, help="GB: the export is stopped past it (onnx_phases)")
    ap.add_argument("--root", type=Path, default=None, help="where scripts/bench/generate.py's checkpoints are made")
    args = ap.parse_args()
    import onnxruntime
    from transformers import GPT2LMHeadModel

    from gpt2port.targets.onnx import FILE_NAME, greedy
    from tests.realistic import realistic_checkpoint

    work = Path(tempfile.mkdtemp(dir=args.work))
    try:
        if args.root:
            from scripts.bench.generate import prepare

            hf_dir, ckpt = prepare(args.size, args.root)
        else:
            hf_dir, ckpt = realistic_checkpoint(work, args.size, seed=7)
        print(f"{args.size}, random weights from {ckpt}; load average {os.getloadavg()[0]:.1f} at the start")
        for dtype in args.dtype:
            out = work / f"onnx-{dtype}"
            phases = work / "phases.txt"
            try:
                wall, rss, cpu = timed(["sh", "-c", f"exec {sys.executable} -m scripts.bench.onnx_phases export "
                                        f"'{ckpt}' --rss-limit {args.rss_limit} --to onnx --dtype {dtype} "
                                        f"--out '{out}' 2> '{phases}'"])
            finally:  # the steps so far, and why it stopped where it failed
                print(phases.read_text().rstrip(), flush=True)
            proof = json.loads((out / "manifest.json").read_text())["proof"]
            sizes = ", ".join(f"{f.name} {f.stat().st_size / 1e9:.3f} GB" for f in sorted(out.glob(f"{FILE_NAME}*")))
            # onnxruntime alone, then transformers alone: at gpt2-xl each holds the weights once more
            session = onnxruntime.InferenceSession(str(out / FILE_NAME), providers=["CPUExecutionProvider"])
            ids = torch.randint(0, 50257, (1, 12), generator=torch.Generator().manual_seed(1))
            tokens, logits = greedy(session, ids, torch.ones_like(ids), 9)
            del session
            hf = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=torch.float32).eval()
            with torch.no_grad():
                want = hf(tokens).logits[:, :-1]
            del hf
            rel = float((logits - want).abs().max() / want.abs().max())
            same = int((logits.argmax(-1) == want.argmax(-1)).sum())
            print(f"{dtype}: export {wall:.1f} s wall, {cpu:.1f} CPU s, peak RSS {rss / 1024**2:.2f} GB | {sizes} | "
                  f"proof rel {proof['max_rel_error']:.1e}, greedy {proof['greedy_agree']} | vs transformers rel "
                  f"{rel:.1e}, greedy tokens agree {same}/{want.size(1)} | load average {os.getloadavg()[0]:.1f}",
                  flush=True)
            shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
