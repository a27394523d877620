"""What each quantized GGUF type costs in accuracy: size, bits per weight, and the KL divergence and top-1 agreement
of its next-token distributions against the fp32 model's, measured twice on the same file: by gpt2port (the file
converted back, dequantized, run in gpt2port's GPT) and by llama.cpp (llama-cpp-python running the file).

    python -m scripts.bench.gguf_quant_error CKPT [--types q8_0,q6_k,...] [--work DIR]

KL(fp32 || quantized) in nats, averaged over the positions of a fixed English text (the MIT license, ~300 tokens);
top-1: the share of positions whose most likely next token is the fp32 model's. Bits per weight: the tensors' bytes
x 8 over their values, as llama-quantize reports it (vectors and the position table included, in F32). llama.cpp's
numbers include its own fp32 error (its fp16-table GELU: see docs/export.md), so its fp32 row is the floor.
Needs llama-cpp-python for the llama.cpp columns (they read "-" without it).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch

from gpt2port import checkpoint, convert, export
from gpt2port.model import GPT
from gpt2port.registry import GGUF_QUANTS
from gpt2port.targets.gguf import FILE_NAME
from gpt2port.targets.llmc import TEXT


def _metrics(logits: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(mean KL(ref || logits) in nats, top-1 agreement) over positions, from two (T, V) logit arrays."""
    ref_lp = torch.log_softmax(torch.from_numpy(ref).double(), -1)
    lp = torch.log_softmax(torch.from_numpy(logits).double(), -1)
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).mean().item()
    return kl, float((logits.argmax(-1) == ref.argmax(-1)).mean())


def _llama_logits(path: Path, ids: list[int], n_ctx: int) -> np.ndarray | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(str(path), logits_all=True, n_ctx=n_ctx, n_threads=2, verbose=False)
    llm.eval(ids)
    out = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    llm.close()
    return out


def measure(ckpt: Path, types: list[str], work: Path) -> list[dict]:
    ids = checkpoint.load_tokenizer(ckpt).encode(TEXT)[:320]
    idx = torch.tensor([ids])
    with torch.no_grad():
        ref = GPT.from_pretrained(ckpt, dtype="fp32")(idx)[0][0].numpy()
    n_ctx = len(ids) + 8
    rows = []
    for dtype in types:
        out = work / dtype
        export(ckpt, out, to="gguf", dtype=dtype, force=True)
        path = out / FILE_NAME
        tensors = gguf.GGUFReader(path).tensors
        bpw = 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)
        convert(path, work / f"{dtype}-back", force=True)
        with torch.no_grad():
            ours = GPT.from_pretrained(work / f"{dtype}-back", dtype="fp32")(idx)[0][0].numpy()
        theirs = _llama_logits(path, ids, n_ctx)
        rows.append({"type": dtype, "mb": path.stat().st_size / 1e6, "bpw": bpw, "ours": _metrics(ours, ref),
                     "llama": _metrics(theirs, ref) if theirs is not None else None})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--types", default=",".join(("fp32", *GGUF_QUANTS)))
    ap.add_argument("--work", type=Path, default=None, help="where the files go (default: a temporary dir)")
    args = ap.parse_args()
    print("| type | file MB | bits/weight | KL gpt2port | top-1 gpt2port | KL llama.cpp | top-1 llama.cpp |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        for r in measure(args.ckpt, args.types.split(","), Path(tmp)):
            kl, top1 = r["ours"]
            theirs = "| - | -" if r["llama"] is None else f"| {r['llama'][0]:.2e} | {r['llama'][1]:.3f}"
            print(f"| {r['type']} | {r['mb']:.1f} | {r['bpw']:.2f} | {kl:.2e} | {top1:.3f} {theirs} |", flush=True)


if __name__ == "__main__":
    main()
