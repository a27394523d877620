"""How far 8-bit logits stray from fp32, position by position, for gpt2port's int8 and llama.cpp's q8_0 on the same
weights.

Random-weight GPT-2 (the same hub-layout file scripts/bench/generate.py writes), random token ids, and for every
position: max |logit - fp32 logit| / max |fp32 logit| at that position. Reported as the median, 90th percentile and
maximum over the positions, for:

  gpt2port int8, decode    one token at a time through the KV cache, as `generate` runs: fbgemm's kernel, whose
                           activations are quantized to 8 bits per token (weights and activations both rounded)
  gpt2port int8, int8pack  the same steps on the fallback kernel (bf16 activations: the weights' rounding alone)
  gpt2port int8, prefill   the whole sequence in one forward (the dequantized weights in fp32: weights' rounding)
  llama.cpp q8_0           the checkpoint exported as GGUF q8_0, one token at a time (when llama-cpp-python is
                           installed); q8_0 keeps a scale per 32 weights where int8 keeps one per row

--outliers M gives the random weights what trained models have and random ones lack: in every block --gains (3) gains
of each LayerNorm and --units (4) MLP units (their fc rows) scaled M times (seeded), and adds the row
  gpt2port int8, decode, unsmoothed   the decode steps of quant.quantized_model(..., smoothing=False)

Usage (from the repository root):
    python -m scripts.bench.int8_error [--size gpt2] [--tokens 200] [--threads 2] [--workdir DIR]
                                       [--outliers 30 [--gains 3] [--units 4]]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch

from gpt2port import GPT, export, quant
from gpt2port.model import KVCache
from scripts import llamacpp
from scripts.bench.generate import prepare


def per_position(logits: torch.Tensor, ref: torch.Tensor) -> list[float]:
    """(T, V) logits against (T, V) reference -> T relative errors."""
    return ((logits.float() - ref).abs().amax(-1) / ref.abs().amax(-1)).tolist()


def stepwise(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """(T, V) logits of feeding ids (1, T) one token at a time through a KV cache."""
    cache = KVCache(model.config, 1, ids.size(1), torch.float32, "cpu")
    return torch.cat([model(ids[:, t : t + 1], cache=cache, pos=t)[0][0] for t in range(ids.size(1))])


def int8_rows(ckpt: Path, ids: torch.Tensor, ref: torch.Tensor) -> dict[str, list[float]]:
    rows = {}
    model = GPT.from_pretrained(ckpt, dtype="int8")
    rows["gpt2port int8, decode (fbgemm)" if model.lm_head._packed is not None else "gpt2port int8, decode"] = \
        per_position(stepwise(model, ids), ref)
    rows["gpt2port int8, prefill (dequantized)"] = per_position(model(ids)[0][0], ref)
    rows["gpt2port int8, decode, unsmoothed"] = per_position(
        stepwise(quant.quantized_model(GPT, ckpt, smoothing=False), ids), ref)
    # the fallback kernel, for the weights' share of the error
    rows["gpt2port int8, decode (int8pack)"] = per_position(
        stepwise(quant.quantized_model(GPT, ckpt, fbgemm=False), ids), ref)
    return rows


def with_outliers(ckpt: Path, out: Path, factor: float, gains: int = 3, units: int = 4) -> Path:
    """ckpt's weights with, in every block, `gains` gains of each LayerNorm and `units` MLP units scaled `factor`
    times."""
    model = GPT.from_pretrained(ckpt)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for block in model.blocks:
            for ln in (block.ln1, block.ln2):
                ln.weight[torch.randperm(ln.weight.numel(), generator=g)[:gains]] *= factor
            block.mlp.fc.weight[torch.randperm(block.mlp.fc.out_features, generator=g)[:units]] *= factor
    model.save_pretrained(out, force=True)
    return out


def llama_row(ckpt: Path, ids: torch.Tensor, ref: torch.Tensor, work: Path) -> list[float] | None:
    if llamacpp.library() is None:
        return None
    from gpt2port.targets.gguf import FILE_NAME

    export(ckpt, work, to="gguf", dtype="q8_0", force=True)
    return per_position(torch.from_numpy(llamacpp.logits(work / FILE_NAME, ids, one_at_a_time=True)), ref)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="gpt2")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--workdir", type=Path, default=None, help="keep the random checkpoints here for reuse")
    ap.add_argument("--outliers", type=float, default=None, help="scale a few channels per block this many times")
    ap.add_argument("--gains", type=int, default=3, help="with --outliers: LayerNorm gains per norm")
    ap.add_argument("--units", type=int, default=4, help="with --outliers: MLP units per block")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="int8-error-") as tmp:
        root = args.workdir or Path(tmp)
        _, ckpt = prepare(args.size, root)
        if args.outliers:
            ckpt = with_outliers(ckpt, root / f"{args.size}-outliers-{args.outliers:g}-{args.gains}-{args.units}",
                                 args.outliers, args.gains, args.units)
        ids = torch.randint(0, 50257, (1, args.tokens), generator=torch.Generator().manual_seed(args.seed))
        with torch.inference_mode():
            ref = GPT.from_pretrained(ckpt)(ids)[0]
            rows = int8_rows(ckpt, ids, ref)
            llama = llama_row(ckpt, ids, ref, root / f"{args.size}-q8_0-error")
        if llama is not None:
            rows["llama.cpp q8_0, decode"] = llama
    kind = (f"random weights with outlier channels ({args.outliers:g}x: {args.gains} gains per norm, {args.units} MLP "
            f"units per block)" if args.outliers else "random weights")
    print(f"{args.size}, {kind}, {args.tokens} random token ids (seed {args.seed}): per position, "
          f"max|logit - fp32| / max|fp32 logit|")
    print("| | median | 90th percentile | max |\n|---|---:|---:|---:|")
    for name, errs in rows.items():
        errs = sorted(errs)
        print(f"| {name} | {statistics.median(errs):.2e} | {errs[int(0.9 * (len(errs) - 1))]:.2e} | {errs[-1]:.2e} |")


if __name__ == "__main__":
    main()
