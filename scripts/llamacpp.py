"""llama.cpp's logits for a GGUF file, through llama-cpp-python (not a gpt2port dependency: it builds llama.cpp from
source). The one copy the proof and error scripts share.

    logits(path, ids)                       # (T, V) float32, all positions, the ids as one batch
    logits(path, ids, one_at_a_time=True)   # one eval per token, as a decoder runs (and as `generate` does)
"""

from __future__ import annotations

import numpy as np
import torch


def library():
    """The llama_cpp module, or None where llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


def load(path, n_ctx: int, **kw):
    """A llama_cpp.Llama over the GGUF at `path` keeping every position's logits, on torch's thread count; kw
    (lora_path=...) passed on."""
    import llama_cpp

    threads = torch.get_num_threads()
    return llama_cpp.Llama(str(path), logits_all=True, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                           verbose=False, **kw)


def run(llm, ids, one_at_a_time: bool = False) -> np.ndarray:
    """(T, V) logits of a loaded Llama for the token ids (a list, or a (1, T) / (T,) tensor), from an empty cache."""
    ids = [int(i) for i in (ids.flatten().tolist() if isinstance(ids, torch.Tensor) else ids)]
    llm.reset()
    if one_at_a_time:
        for i in ids:
            llm.eval([i])
    else:
        llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def logits(path, ids, one_at_a_time: bool = False, n_ctx: int | None = None, **kw) -> np.ndarray:
    """(T, V) llama.cpp logits of the GGUF at `path` for `ids`; the model is freed before returning."""
    n = ids.numel() if isinstance(ids, torch.Tensor) else len(ids)
    llm = load(path, n_ctx or n, **kw)
    try:
        return run(llm, ids, one_at_a_time)
    finally:
        llm.close()
