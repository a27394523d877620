"""GGUF Q8_0 read back: a q8_0 export of realistic-scale weights converts to a checkpoint whose weights are exactly
the file's q8_0 values (as llama.cpp's `gguf` package dequantizes them), reported as dequantized; a damaged q8_0
tensor and the quantized types gpt2port does not write are refused in one line."""

from __future__ import annotations

import hashlib
import json
import struct

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from gpt2port import export
from gpt2port.layouts.gguf import GGUF
from gpt2port.targets.gguf import FILE_NAME
from scripts.hf_fixtures import TINY
from tests.realistic import realistic_checkpoint
from tests.support import assert_clean_failure, leftovers, run_cli

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    """(fp32 checkpoint, its q8_0 GGUF export) of realistic-scale weights."""
    out = tmp_path_factory.mktemp("q8_0")
    _, ckpt = realistic_checkpoint(out, TINY, seed=3)
    export(ckpt, out / "g", to="gguf", dtype="q8_0")
    return ckpt, out / "g" / FILE_NAME


def _reference(path) -> dict:
    """Every tensor of the file as the `gguf` package reads and dequantizes it, by GGUF name."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type) if t.tensor_type == Q.Q8_0 else t.data
        out[t.name] = (t.tensor_type, torch.from_numpy(np.array(values, dtype=np.float32)))
    return out


def test_convert_gives_exactly_the_dequantized_values(q8, tmp_path):
    fp32, path = q8
    result = run_cli("convert", path, "--out", tmp_path / "back")
    assert result.exit_code == 0, result.output
    assert "fp32 dequantized from q8_0" in result.output  # not claimed as the fp32 model it was made from
    got, original = load_file(tmp_path / "back" / "model.safetensors"), load_file(fp32 / "model.safetensors")
    reference = _reference(path)
    assert got.keys() == original.keys()
    quantized = 0
    for name, tensor in got.items():
        qtype, want = reference[GGUF.key_for(name)]
        assert tensor.dtype == torch.float32 and torch.equal(tensor, want.reshape(tensor.shape)), name
        if qtype == Q.Q8_0:  # moved by the quantization, a little: a q8_0 step is at most 1/254 of a block's max
            quantized += 1
            error = (tensor - original[name]).abs()
            assert 0 < error.max() and (error.max() <= original[name].abs().max() / 127), name
        else:
            assert qtype == Q.F32 and torch.equal(tensor, original[name]), name
    assert quantized == 1 + 4 * TINY["n_layer"]  # the embedding and every block's four matrices
    source = json.loads((tmp_path / "back" / "manifest.json").read_text())["source"]
    assert source["encoding"] == "q8_0"
    assert hashlib.sha256(path.read_bytes()).hexdigest() in json.dumps(source["files"])  # hashed as it was read


def _patched(data: bytes, name: str, dims=None, ggml_type=None) -> bytes:
    """`data` (a GGUF) with tensor `name`'s info given other dims or another GGML type."""
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", data, at)
    out = bytearray(data)
    if dims is not None:
        struct.pack_into(f"<{n_dims}Q", out, at + 4, *dims)
    if ggml_type is not None:
        struct.pack_into("<I", out, at + 4 + 8 * n_dims, ggml_type)
    return bytes(out)


def test_damaged_q8_0_and_other_quantized_types_are_refused(q8, tmp_path):
    _, path = q8
    good = path.read_bytes()
    tensors = gguf.GGUFReader(path).tensors
    last = max((t for t in tensors if t.tensor_type == Q.Q8_0), key=lambda t: t.data_offset)
    cut = last.data_offset + last.n_bytes // 2
    cases = {  # file name -> (its bytes, what the refusal says)
        "cut.gguf": (good[:cut], f"truncated: tensor {last.name!r}"),
        "rows.gguf": (_patched(good, "token_embd.weight", dims=(33, TINY["vocab_size"])),
                      "'token_embd.weight' is Q8_0 with rows of 33 values; Q8_0 needs a multiple of 32"),
        "q2.gguf": (_patched(good, "blk.0.ffn_up.weight", ggml_type=Q.Q2_K),
                    "'blk.0.ffn_up.weight' is quantized (Q2_K)"),
    }
    for name, (data, reason) in cases.items():
        (tmp_path / name).write_bytes(data)
        result = run_cli("convert", tmp_path / name, "--out", tmp_path / "out" / name)
        line = assert_clean_failure(result, names=[tmp_path / name])
        assert reason in line, line
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)
