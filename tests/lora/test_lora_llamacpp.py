"""llama.cpp itself (llama-cpp-python's lora_path) runs the adapter GGUF over the base's GGUF and computes what it
computes on the merged model's GGUF, and what gpt2port computes with the adapter (scripts/bench/lora_llamacpp.py).
Skipped where llama-cpp-python is not installed (it builds llama.cpp from source; CI does not have it)."""

from __future__ import annotations

import pytest

from scripts.bench.lora_llamacpp import check, realistic_adapter
from tests.lora.helpers import ALL

pytest.importorskip("llama_cpp")

# llama.cpp against itself: the adapter's two extra products against one merged matrix (f32: measured ~3e-4; an
# fp16 adapter rounds A and B and llama.cpp's input to them: ~4e-3). llama.cpp against gpt2port: its CPU GELU goes
# through an fp16 table (~2e-3 .. 4e-3 at these scales, as the plain GGUF export).
CASES = {"fp32, q|k|v apart, qkv+fc": ("fp32", ("qkv", "fc"), True, 1e-3),
         "fp32, fused, all four": ("fp32", ALL, False, 1e-3),
         "fp16, fused, all four": ("fp16", ALL, False, 1e-2)}


@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_with_the_adapter_equals_llama_cpp_on_the_merged_model(case, tmp_path):
    dtype, targets, split, bound = CASES[case]
    ckpt, adapter = realistic_adapter(tmp_path, targets, rank=4, alpha=8.0, split_qkv=split)
    r = check(ckpt, adapter, tmp_path, dtype)
    assert r["adapter_moves_logits"] > 0.1, r  # the adapter changes what llama.cpp computes, by far more than...
    assert r["adapter_vs_merged"] <= bound, r  # ...llama.cpp + adapter differs from llama.cpp on the merged model
    assert r["merged_vs_gpt2port"] <= 1e-2, r
    assert r["adapter_vs_gpt2port"] <= 1e-2, r
