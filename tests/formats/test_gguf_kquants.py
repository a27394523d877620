"""llama.cpp's quantized GGUF types written by gpt2port: byte for byte ggml's own quantizer (where llama-cpp-python
is installed), llama.cpp's choice of type per tensor for each file type, and every type read back by `convert`."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from gpt2port import export
from gpt2port.formats import gguf_quants
from gpt2port.layouts.gguf import GGUF
from gpt2port.targets.gguf import FILE_NAME, storage_type
from scripts.check_gguf_kquants import hard_matrix
from tests.realistic import realistic_checkpoint
from tests.support import run_cli

Q = gguf.GGMLQuantizationType
# RMS error over RMS value of realistic-scale rows (with their outlier columns), as measured on them x1.2: a
# quantizer that lost precision (a wrong scale, levels off by one in many places) goes past it
RMS_LIMITS = {Q.Q4_0: 0.14, Q.Q4_1: 0.106, Q.Q5_0: 0.069, Q.Q5_1: 0.052, Q.Q8_0: 0.0089, Q.Q4_K: 0.098,
              Q.Q5_K: 0.05, Q.Q6_K: 0.027}
HARD_ROWS = 9  # hard_matrix's first rows: edge cases, not realistic values


@pytest.mark.parametrize("qtype", gguf_quants.TYPES, ids=lambda q: q.name)
def test_round_trip_error_is_the_types(qtype):
    x = hard_matrix(40, 512, seed=1)
    raw = gguf_quants.quantize(x, qtype)
    assert raw.shape == (40, 512 // gguf.GGML_QUANT_SIZES[qtype][0] * gguf.GGML_QUANT_SIZES[qtype][1])
    back = gguf_quants.dequantize(raw, qtype, x.size).reshape(x.shape)
    assert np.array_equal(back, gguf.quants.dequantize(raw, qtype))  # read as llama.cpp's own reader does
    assert not back[0].any()  # zeros stay zeros
    real, err = x[HARD_ROWS:], back[HARD_ROWS:] - x[HARD_ROWS:]
    rms = float(np.sqrt((err**2).mean() / (real**2).mean()))
    assert RMS_LIMITS[qtype] / 2 < rms < RMS_LIMITS[qtype], rms


@pytest.mark.parametrize("width", [768, 1600, 3072])
def test_bytes_equal_ggml(width):
    pytest.importorskip("llama_cpp")
    from scripts.check_gguf_kquants import check_blocks

    results = check_blocks(width, rows=48)
    assert set(results) == {q.name for q in gguf_quants.TYPES if width % gguf.GGML_QUANT_SIZES[q][0] == 0}
    assert all(equal == rows for equal, rows in results.values()), results


def _types(recipe: str, width: int, n_layer: int, tied: bool = True) -> dict[str, set]:
    """GGML type name -> the tensors (by GGUF name) a GPT-2 of that shape stores in it."""
    shapes = {"token_embd.weight": (50257, width), **({} if tied else {"output.weight": (50257, width)})}
    for i in range(n_layer):
        shapes |= {f"blk.{i}.attn_qkv.weight": (3 * width, width), f"blk.{i}.attn_output.weight": (width, width),
                   f"blk.{i}.ffn_up.weight": (4 * width, width), f"blk.{i}.ffn_down.weight": (width, 4 * width)}
    out: dict[str, set] = {}
    for key, shape in shapes.items():
        out.setdefault(storage_type(key, shape, recipe, n_layer, tied).name, set()).add(key)
    return out


def _blk(kind: str, layers) -> set:
    return {f"blk.{i}.{kind}.weight" for i in layers}


def test_recipes_choose_llama_cpps_types():
    # 124M, Q4_K_M: use_more_bits(i, 12) holds for layers 0, 3, 6, 9 (every third after the first eighth), 10, 11
    more = {0, 3, 6, 9, 10, 11}
    rest = set(range(12)) - more
    assert _types("q4_k_m", 768, 12) == {
        "Q6_K": {"token_embd.weight"} | _blk("attn_qkv", more) | _blk("ffn_down", more),
        "Q4_K": _blk("attn_qkv", rest) | _blk("ffn_down", rest) | _blk("attn_output", range(12))
        | _blk("ffn_up", range(12))}
    assert _types("q4_k_s", 768, 12) == {
        "Q6_K": {"token_embd.weight"},
        "Q5_K": _blk("attn_qkv", range(4)) | _blk("ffn_down", {0}),
        "Q4_K": _blk("attn_qkv", range(4, 12)) | _blk("ffn_down", range(1, 12)) | _blk("attn_output", range(12))
        | _blk("ffn_up", range(12))}
    # an output.weight takes the Q6_K; the embedding then is an ordinary matrix
    untied = _types("q5_k_s", 768, 12, tied=False)
    assert untied["Q6_K"] == {"output.weight"} and "token_embd.weight" in untied["Q5_K"]
    assert _types("q4_0", 768, 2)["Q6_K"] == {"token_embd.weight"}
    assert _types("q8_0", 768, 2) == {"Q8_0": set(_types("q8_0", 768, 2)["Q8_0"])}
    # xl: 1600 is not a multiple of 256, so every K-quant but ffn_down's (6400 wide) falls back
    layers = range(48)
    more = {i for i in layers if i < 6 or i >= 42 or (i - 6) % 3 == 2}
    assert _types("q4_k_m", 1600, 48) == {
        "Q8_0": {"token_embd.weight"} | _blk("attn_qkv", more), "Q6_K": _blk("ffn_down", more),
        "Q5_0": _blk("attn_qkv", set(layers) - more) | _blk("attn_output", layers) | _blk("ffn_up", layers),
        "Q4_K": _blk("ffn_down", set(layers) - more)}
    assert _types("q5_k_s", 1600, 48) == {
        "Q8_0": {"token_embd.weight"}, "Q5_K": _blk("ffn_down", layers),
        "Q5_1": _blk("attn_qkv", layers) | _blk("attn_output", layers) | _blk("ffn_up", layers)}
    assert set(_types("q6_k", 1600, 2)) == {"Q8_0", "Q6_K"}


@pytest.fixture(scope="module")
def k_quantized(tmp_path_factory):
    """(fp32 checkpoint, its q4_k_m GGUF) of a realistic-scale GPT-2 256 wide (K-quant rows) and 2 layers deep."""
    out = tmp_path_factory.mktemp("q4_k_m")
    _, ckpt = realistic_checkpoint(out, dict(n_layer=2, n_head=4, n_embd=256, n_positions=64, vocab_size=50257))
    export(ckpt, out / "g", to="gguf", dtype="q4_k_m")
    return ckpt, out / "g" / FILE_NAME


def test_convert_reads_k_quants_back(k_quantized, tmp_path):
    fp32, path = k_quantized
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert stored["token_embd.weight"].tensor_type == Q.Q6_K and stored["blk.1.ffn_up.weight"].tensor_type == Q.Q4_K
    result = run_cli("convert", path, "--out", tmp_path / "back")
    assert result.exit_code == 0, result.output
    assert "fp32 dequantized from q4_k, q6_k" in result.output
    got, original = load_file(tmp_path / "back" / "model.safetensors"), load_file(fp32 / "model.safetensors")
    for name, tensor in got.items():
        t = stored[GGUF.key_for(name)]
        want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type) if t.tensor_type != Q.F32 else t.data
        assert torch.equal(tensor, torch.from_numpy(np.array(want, dtype=np.float32)).reshape(tensor.shape)), name
        if t.tensor_type != Q.F32:
            rms = ((tensor - original[name]).square().mean() / original[name].square().mean()).sqrt()
            assert 0 < rms < RMS_LIMITS[Q(t.tensor_type)], (name, rms)
    manifest = json.loads((tmp_path / "back" / "manifest.json").read_text())
    assert manifest["source"]["encoding"] == "q4_k, q6_k"


@pytest.mark.heavy
@pytest.mark.parametrize("width", [768, 1600])
def test_exports_equal_llama_quantize(width, tmp_path):
    """Every type, every tensor: the file llama-cpp-python's llama_model_quantize writes from the f32 export."""
    pytest.importorskip("llama_cpp")
    from gpt2port.registry import GGUF_QUANTS
    from scripts.check_gguf_kquants import check_files, realistic_gpt2

    ckpt = realistic_gpt2(tmp_path / "model", width, layers=4)
    for recipe, r in check_files(ckpt, GGUF_QUANTS, tmp_path):
        assert r["problems"] == [], (recipe, r["problems"][:5])



@pytest.mark.parametrize("qtype", gguf_quants.TYPES[:5], ids=lambda q: q.name)
def test_32_value_types_equal_the_gguf_packages_ports(qtype):
    """gpt2port's vectorized Q4_0..Q8_0 against the `gguf` package's ports of ggml's reference (which run 16 blocks
    a call; test_bytes_equal_ggml holds both to ggml itself where llama-cpp-python is installed)."""
    x = hard_matrix(64, 1600, seed=2)
    assert np.array_equal(gguf_quants.quantize(x, qtype, threads=2), gguf.quants.quantize(x, qtype))
