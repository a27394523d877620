"""How far 4-bit logits stray from fp32: gpt2port's int4 (`--dtype int4`) and llama.cpp's Q4_K_M on the same weights.

Trained-like weights (tests/realistic.py's scales on a GPT-2 shape: peaked attention, MLP pre-activations of std ~2,
outlier residual channels; random weights at the 0.02 init barely move the logits under any rounding) and real
English text (the license text the OS or Python ships, scripts/eval_data.py). Per position: KL(fp32 || quantized) of
the next-token distributions, and whether the top token agrees. Rows:

  gpt2port int4, decode    one token at a time through the KV cache, as `generate` runs (gpt2port::matvec_int4)
  gpt2port int4, prefill   the whole text in one forward (blocks of the weight dequantized to fp32)
  llama.cpp Q4_K_M         the checkpoint exported as f32 GGUF by gpt2port, quantized by llama.cpp's own
                           llama_model_quantize (no importance matrix, as llama-quantize by default), decoded one
                           token at a time (when llama-cpp-python is installed)

and the bytes each holds for the matrices (file size for the GGUF).

Usage (from the repository root):
    python -m scripts.bench.int4_error [--size gpt2] [--tokens 256] [--threads 2] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from gpt2port import GPT, export, load_tokenizer
from gpt2port.fast import Settings, accelerate
from gpt2port.fast.int4 import from_pretrained
from gpt2port.model import KVCache
from scripts.bench.generate import prepare

Q4_K_M = 15  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M


def trained_like(size: str, root: Path) -> Path:
    """A checkpoint of GPT-2 `size`'s shape with tests/realistic.py's weights (made once under root)."""
    from tests.realistic import make_realistic_

    out = root / f"{size}-realistic"
    if not (out / "model.safetensors").is_file():
        _, ckpt = prepare(size, root)
        make_realistic_(GPT.from_pretrained(ckpt), seed=0).save_pretrained(out, force=True)
    return out


def scores(logits: torch.Tensor, ref: torch.Tensor) -> tuple[list[float], list[bool]]:
    """(T, V) logits against (T, V) fp32 -> (KL(ref || logits) per position, top-1 agreement per position)."""
    kl = F.kl_div(logits.float().log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    return kl.tolist(), (logits.argmax(-1) == ref.argmax(-1)).tolist()


def stepwise(model, ids: torch.Tensor) -> torch.Tensor:
    cache = KVCache(model.config, 1, ids.size(1), torch.float32, "cpu")
    return torch.cat([model(ids[:, t : t + 1], cache=cache, pos=t)[0][0] for t in range(ids.size(1))])


def matrix_bytes(model) -> int:
    seen, total = set(), 0
    for t in (*model.parameters(), *model.buffers()):
        if t.data_ptr() not in seen and t.dim() == 2 and t is not model.pos_emb.weight:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def llama_q4_k_m(ckpt: Path, ids: torch.Tensor, work: Path) -> tuple[torch.Tensor, int] | None:
    """((T, V) logits of llama.cpp's Q4_K_M of ckpt, one token at a time, the file's bytes), or None without
    llama-cpp-python."""
    try:
        import llama_cpp
    except ImportError:
        return None

    from gpt2port.targets.gguf import FILE_NAME

    quantized = work / "q4_k_m.gguf"
    if not quantized.is_file():
        export(ckpt, work / "f32", to="gguf", dtype="fp32", force=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = Q4_K_M
        params.nthread = torch.get_num_threads()
        status = llama_cpp.llama_model_quantize(str(work / "f32" / FILE_NAME).encode(), str(quantized).encode(),
                                                params)
        if status != 0:
            raise RuntimeError(f"llama_model_quantize returned {status}")
    from scripts import llamacpp

    return torch.from_numpy(llamacpp.logits(quantized, ids, one_at_a_time=True)), quantized.stat().st_size


def main() -> None:
    from scripts.eval_data import english

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="gpt2")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--workdir", type=Path, default=None, help="keep the checkpoints and GGUF files here for reuse")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows: dict[str, tuple[list[float], list[bool], int]] = {}
    with tempfile.TemporaryDirectory(prefix="int4-error-") as tmp:
        root = args.workdir or Path(tmp)
        ckpt = trained_like(args.size, root)
        text = english() or ""
        ids = torch.tensor([load_tokenizer(ckpt).encode(text)[: args.tokens]])
        with torch.inference_mode():
            fp32 = GPT.from_pretrained(ckpt)
            ref = fp32(ids)[0][0]
            del fp32
            q = accelerate(from_pretrained(ckpt, "int4"), Settings())
            size = matrix_bytes(q)
            rows["gpt2port int4, decode"] = (*scores(stepwise(q, ids), ref), size)
            rows["gpt2port int4, prefill"] = (*scores(q(ids)[0][0], ref), size)
            del q
            llama = llama_q4_k_m(ckpt, ids, root / f"{ckpt.name}-q4_k_m")  # not int4_speed.py's random weights
        if llama is not None:
            rows["llama.cpp Q4_K_M, decode"] = (*scores(llama[0], ref), llama[1])
    print(f"{args.size} shape, trained-like weights (tests/realistic.py), {ids.size(1)} tokens of English text: "
          f"KL(fp32 || quantized) per position and top-1 agreement")
    print("| | KL mean | KL median | KL 90th pct | top-1 | matrices' bytes |\n|---|---:|---:|---:|---:|---:|")
    for name, (kl, top1, nbytes) in rows.items():
        s = sorted(kl)
        print(f"| {name} | {statistics.fmean(kl):.3f} | {statistics.median(kl):.3f} | {s[int(0.9 * (len(s) - 1))]:.3f} "
              f"| {sum(top1) / len(top1):.1%} | {nbytes / 1e6:.1f} MB |")


if __name__ == "__main__":
    main()
