"""llama.cpp runs each quantized GGUF export and its logits stay as close to the fp32 model's as the type's own
rounding allows (needs llama-cpp-python; skipped without it).

The bound per type comes from gpt2port's own measurement: the same model with every matrix quantized to the type the
export gives it and dequantized in memory (scripts/bench/gguf_quant_error.dequantized, no file involved). llama.cpp
running the file may add only its own arithmetic: 8-bit activations in each quantized product and an fp16-table
GELU (measured on this model: +37% on Q8_0, whose weights' error is small, +1..10% on the others). A file that
llama.cpp reads otherwise than gpt2port meant (a tensor under another's name, a matrix transposed, a wrong type or
scale) moves its KL far past that. The quantizers' bytes are held to ggml's by tests/formats/test_gguf_kquants.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")

from gpt2port.registry import GGUF_QUANTS
from scripts.bench.gguf_quant_error import measure
from tests.realistic import realistic_checkpoint

RATIO, SLACK = 1.25, 5e-3  # KL(fp32 || llama.cpp) <= RATIO * KL(fp32 || gpt2port's dequantized) + SLACK (nats)
TOKENS = 48


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A realistic-scale GPT-2, 256 wide (rows every K-quant takes) and 2 layers deep (Q4_K_M's layer 1 takes
    Q6_K, layer 0 Q4_K)."""
    out = tmp_path_factory.mktemp("quant-llamacpp")
    return realistic_checkpoint(out, dict(n_layer=2, n_head=4, n_embd=256, n_positions=64, vocab_size=50257))[1]


@pytest.mark.heavy  # ~20-60 s a type on 2 cores: a checkpoint with the real vocabulary, an export, llama.cpp's load
@pytest.mark.parametrize("dtype", GGUF_QUANTS)
def test_llama_cpp_runs_the_export_within_the_types_error(model, dtype, tmp_path):
    (row,) = measure(model, [dtype], tmp_path, tokens=TOKENS)
    ours, theirs = row["ours"][0], row["llama"][0]
    assert ours > 1e-4, row  # the type rounds the weights: a bound of nothing would be no test
    assert theirs <= RATIO * ours + SLACK, row
    assert not list(tmp_path.iterdir())  # each file deleted once measured
