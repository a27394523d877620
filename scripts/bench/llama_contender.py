"""llama.cpp as a contender of scripts/bench/generate.py: the same weights exported as q8_0 GGUF by gpt2port, decoded
greedily through llama.cpp's own sampler (llama-cpp-python, when it is installed)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from gpt2port import export


def q8_0_model(ckpt: Path, out: Path, n_ctx: int):
    """(llama_cpp.Llama over the checkpoint exported as q8_0 GGUF with room for n_ctx positions, bytes its decode
    step streams), or None without llama-cpp-python."""
    try:
        import llama_cpp
    except ImportError:
        return None
    from gguf import GGUFReader

    from gpt2port.targets.gguf import FILE_NAME

    if not (out / FILE_NAME).is_file():
        export(ckpt, out, to="gguf", dtype="q8_0", force=True)
    total = 0
    for t in GGUFReader(out / FILE_NAME).tensors:
        rows = int(t.shape[-1]) if t.name == "position_embd.weight" else 1  # one position row per step
        total += int(t.n_bytes) // rows
    llm = llama_cpp.Llama(str(out / FILE_NAME), n_ctx=n_ctx, n_threads=torch.get_num_threads(),
                          n_threads_batch=torch.get_num_threads(), verbose=False)
    return llm, total


def decode(llm, prompt: torch.Tensor, new_tokens: int) -> tuple[float, list[int]]:
    """Greedy through llama.cpp's own sampler (top-k 1), the prompt's prefill included, as for gpt2port and HF:
    (tokens/s, the tokens)."""
    # Forget the previous run's tokens: generate() otherwise keeps the cache of the longest prefix the new prompt
    # shares with them and prefills only the rest (a run after the first skipped all but one prompt token).
    llm.reset()
    out = []
    t = time.perf_counter()
    for token in llm.generate(prompt[0].tolist(), top_k=1, top_p=1.0, temp=0.0, reset=True):
        out.append(int(token))
        if len(out) == new_tokens:
            break
    return new_tokens / (time.perf_counter() - t), out
