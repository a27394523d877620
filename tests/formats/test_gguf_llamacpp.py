"""llama.cpp loads gpt2port's GGUF and computes the same model (needs llama-cpp-python; skipped without it)."""

import pytest

pytest.importorskip("llama_cpp")

from scripts.check_gguf_llamacpp import check


def test_llama_cpp_tokenizes_and_computes_as_gpt2port(tiny_ckpt, tmp_path):
    # Bounds: llama.cpp's CPU GELU uses an fp16 table (f32 ~1e-4..1e-3); q8_0 quantizes every matrix (~1e-2).
    limits = {"fp32": 2e-3, "fp16": 5e-3, "bf16": 2e-2, "q8_0": 5e-2}
    results = check(tiny_ckpt, list(limits), tmp_path)
    for dtype, r in results.items():
        assert r["tokens_equal"], dtype
        assert r["max_rel_err"] < limits[dtype], (dtype, r)
