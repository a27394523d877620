"""What each quantized GGUF type costs in accuracy: size, bits per weight, and the KL divergence and top-1 agreement
of its next-token distributions against the fp32 model's, measured twice: by gpt2port (its GPT with every matrix
quantized to the type the export gives it and dequantized, in memory, by gpt2port/formats/gguf_quants.py: the values
the file holds) and by llama.cpp (llama-cpp-python running the exported file, one token per step).

    python -m scripts.bench.gguf_quant_error CKPT [--types q8_0,q6_k,...] [--tokens 320] [--work DIR]
    python -m scripts.bench.gguf_quant_error DIR --build gpt2-xl [--seed 0] ...

--build SIZE: measure a realistic-scale checkpoint of that preset's shape (tests/realistic.py's weights, the real
vocabulary), built into DIR/ckpt on the first run and reused after (keep DIR outside the repository: 6.2 GB at
gpt2-xl). A 1.5B run holds one fp32 model (6.2 GB) at a time, then a dequantized copy, then llama.cpp's mapping of
one file: run it under the host's big-memory lock.

KL(fp32 || quantized) in nats, averaged over the positions of a fixed English text (the MIT license, ~300 tokens);
top-1: the share of positions whose most likely next token is the fp32 model's. Bits per weight: the tensors' bytes
x 8 over their values, as llama-quantize reports it (vectors and the position table included, in F32). llama.cpp's
numbers include its own fp32 error (its fp16-table GELU: see docs/export.md), so its fp32 row is the floor.
Needs llama-cpp-python for the llama.cpp columns (they read "-" without it). Each type's file is deleted once
measured, so a 1.5B run needs room for one export at a time.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import shutil
import tempfile
import time
from pathlib import Path

import gguf
import torch

from gpt2port import checkpoint, export
from gpt2port.formats import gguf_quants
from gpt2port.layouts.gguf import GGUF
from gpt2port.model import GPT
from gpt2port.registry import GGUF_QUANTS
from gpt2port.targets.gguf import FILE_NAME, storage_type
from gpt2port.targets.llmc import TEXT
from scripts import llamacpp

Q = gguf.GGMLQuantizationType


def metrics(logits: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(mean KL(ref || logits) in nats, top-1 agreement) over positions, from two (T, V) logit tensors."""
    ref_lp = torch.log_softmax(ref.double(), -1)
    lp = torch.log_softmax(logits.double(), -1)
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).mean().item()
    return kl, (logits.argmax(-1) == ref.argmax(-1)).double().mean().item()


@torch.no_grad()
def dequantized(ckpt: Path, dtype: str) -> GPT:
    """ckpt's GPT with each matrix as `export --to gguf --dtype dtype` stores it (llama.cpp's type for that tensor),
    quantized and dequantized in memory: what a correct file holds, computed without one."""
    model = GPT.from_pretrained(ckpt, dtype="fp32")
    cfg = model.config
    for name, p in model.named_parameters():
        qtype = storage_type(GGUF.key_for(name), tuple(p.shape), dtype, cfg.n_layer, cfg.tie_word_embeddings)
        if qtype in (Q.F16, Q.BF16):  # rounded to nearest even either way, as the writer does
            p.copy_(p.to(torch.float16 if qtype == Q.F16 else torch.bfloat16).float())
        elif qtype != Q.F32:
            w = p.detach().numpy()
            raw = gguf_quants.quantize(w, qtype, torch.get_num_threads())
            p.copy_(torch.from_numpy(gguf_quants.dequantize(raw, qtype, w.size).reshape(w.shape)))
    return model


def measure(ckpt: Path, types: list[str], work: Path, tokens: int = 320, progress=None) -> list[dict]:
    """A row per type: file size (mb), bits per weight (bpw), (KL, top-1) of gpt2port's dequantized weights (ours)
    and of llama.cpp running the file (llama: None without llama-cpp-python)."""
    ids = torch.tensor([checkpoint.load_tokenizer(ckpt).encode(TEXT)[:tokens]])
    with torch.no_grad():
        ref = GPT.from_pretrained(ckpt, dtype="fp32")(ids)[0][0]
    lib = llamacpp.library()
    rows = []
    for dtype in types:
        t0, c0 = time.perf_counter(), time.process_time()
        if dtype == "fp32":
            ours = ref  # nothing to round
        else:
            with torch.no_grad():
                ours = dequantized(ckpt, dtype)(ids)[0][0]
            gc.collect()  # the dequantized model gone before llama.cpp maps the file
        out = work / dtype
        export(ckpt, out, to="gguf", dtype=dtype, force=True)
        path = out / FILE_NAME
        tensors = gguf.GGUFReader(path).tensors
        bpw = 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)
        theirs = torch.from_numpy(llamacpp.logits(path, ids, one_at_a_time=True)) if lib else None
        rows.append({"type": dtype, "mb": path.stat().st_size / 1e6, "bpw": bpw, "ours": metrics(ours, ref),
                     "llama": metrics(theirs, ref) if theirs is not None else None, "s": time.perf_counter() - t0,
                     "cpu_s": time.process_time() - c0})
        shutil.rmtree(out)
        if progress:
            progress(rows[-1])
    return rows


def built(root: Path, size: str, seed: int) -> Path:
    """root/ckpt: a realistic-scale checkpoint of preset `size` (tests/realistic.py), made on the first call."""
    from tests.realistic import realistic_checkpoint

    if not (root / "ckpt" / "model.safetensors").is_file():
        realistic_checkpoint(root, size, seed)
        shutil.rmtree(root / "hf")  # the HF copy it converts from: not measured
    return root / "ckpt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--types", default=",".join(("fp32", "fp16", "bf16", *GGUF_QUANTS)))
    ap.add_argument("--tokens", type=int, default=320, help="positions measured (the text's first N tokens)")
    ap.add_argument("--work", type=Path, default=None, help="where the files go (default: a temporary dir)")
    ap.add_argument("--build", metavar="SIZE", default=None,
                    help="CKPT is a directory: measure DIR/ckpt, a realistic-scale checkpoint of preset SIZE "
                         "(gpt2, gpt2-xl, ...) built there if absent")
    ap.add_argument("--seed", type=int, default=0, help="with --build: the weights' seed")
    args = ap.parse_args()
    ckpt = built(args.ckpt, args.build, args.seed) if args.build else args.ckpt
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {ckpt}, {args.tokens} tokens, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}, llama-cpp-python "
          f"{getattr(llamacpp.library(), '__version__', '-')}", flush=True)
    print("| type | file MB | bits/weight | KL gpt2port | top-1 gpt2port | KL llama.cpp | top-1 llama.cpp |")
    print("|---|---:|---:|---:|---:|---:|---:|")

    def row(r):
        kl, top1 = r["ours"]
        theirs = "| - | -" if r["llama"] is None else f"| {r['llama'][0]:.2e} | {r['llama'][1]:.3f}"
        print(f"| {r['type']} | {r['mb']:.1f} | {r['bpw']:.2f} | {kl:.2e} | {top1:.3f} {theirs} |  "
              f"<!-- {r['s']:.0f} s, {r['cpu_s']:.0f} CPU s, load {os.getloadavg()[0]:.1f} -->", flush=True)

    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        measure(ckpt, args.types.split(","), Path(tmp), args.tokens, progress=row)


if __name__ == "__main__":
    main()
