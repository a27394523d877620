"""The format readers behind one protocol: the same tensors whichever file holds them, chosen by file name, read
one at a time, and damaged or misplaced files named."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from gpt2port.errors import GPT2PortError
from gpt2port.readers import READERS, open_weights
from gpt2port.formats.safetensors import read_header, stream_safetensors
from gpt2port.formats.shards import read_index

TENSORS = {"a.weight": torch.arange(12.0).view(3, 4), "b.bias": torch.ones(5, dtype=torch.float16),
           "c": torch.full((2, 2), 7.0, dtype=torch.bfloat16)}


def _write_all(tmp_path):
    """The same three tensors as one safetensors file, a torch pickle, and safetensors shards with an index."""
    save_file(TENSORS, tmp_path / "one.safetensors")
    torch.save(TENSORS, tmp_path / "one.bin")
    save_file({"a.weight": TENSORS["a.weight"]}, tmp_path / "s-1.safetensors")
    save_file({k: TENSORS[k] for k in ("b.bias", "c")}, tmp_path / "s-2.safetensors")
    (tmp_path / "s.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a.weight": "s-1.safetensors", "b.bias": "s-2.safetensors", "c": "s-2.safetensors"}}))
    return ["one.safetensors", "one.bin", "s.safetensors.index.json"]


def test_every_reader_lists_then_reads_the_same_tensors(tmp_path):
    for name in _write_all(tmp_path):
        with open_weights(tmp_path / name) as reader:
            assert {k: (t.dtype, t.shape) for k, t in reader.tensors.items()} == \
                {k: (v.dtype, tuple(v.shape)) for k, v in TENSORS.items()}, name
            buffer = torch.empty(reader.largest(), dtype=torch.uint8)
            for key, want in TENSORS.items():
                assert torch.equal(reader.read(key, into=buffer).clone(), want), (name, key)
            assert reader.files[0].exists()
    # .gguf holds a whole model (names, sizes, tokenizer), not arbitrary tensors: tests/formats/test_gguf.py covers it;
    # a TensorFlow checkpoint (.index) can only be written by TensorFlow: tests/formats/test_tf.py reads genuine ones.
    assert set(READERS) == {".safetensors", ".bin", ".pt", ".pth", ".index.json", ".gguf", ".index"}


def test_the_streaming_writer_writes_what_the_reader_reads(tmp_path):
    items = [(k, v.dtype, tuple(v.shape), (lambda v=v: v)) for k, v in TENSORS.items()]
    stream_safetensors(tmp_path / "out.safetensors", items, {"format": "pt"})
    header = read_header(tmp_path / "out.safetensors")
    assert list(header.entries) == list(TENSORS) and header.metadata == {"format": "pt"}
    with open_weights(tmp_path / "out.safetensors") as reader:
        assert all(torch.equal(reader.read(k), v) for k, v in TENSORS.items())


def test_shard_index_names_only_files_beside_it(tmp_path):
    for bad in ("../elsewhere.safetensors", "/etc/passwd", ".hidden", ""):
        (tmp_path / "i.index.json").write_text(json.dumps({"weight_map": {"a": bad}}))
        with pytest.raises(GPT2PortError, match="not a file name beside the index"):
            read_index(tmp_path / "i.index.json")
    (tmp_path / "i.index.json").write_text(json.dumps({"nothing": 1}))
    with pytest.raises(GPT2PortError, match="no weight_map"):
        read_index(tmp_path / "i.index.json")


def test_unknown_empty_and_misplaced_files_are_named(tmp_path):
    _write_all(tmp_path)
    (tmp_path / "x.onnx").write_bytes(b"ONNX")
    with pytest.raises(GPT2PortError, match=r"x.onnx: unrecognised weights file"):
        open_weights(tmp_path / "x.onnx")
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(GPT2PortError, match="empty.safetensors: file is empty"):
        open_weights(tmp_path / "empty.safetensors")
    (tmp_path / "s.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a.weight": "s-1.safetensors", "b.bias": "s-1.safetensors", "c": "s-2.safetensors"}}))
    with pytest.raises(GPT2PortError, match=r"s-2.safetensors: holds 'b.bias', which s.safetensors.index.json places "
                                            r"in 's-1.safetensors'"):
        open_weights(tmp_path / "s.safetensors.index.json")
    (tmp_path / "s.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a.weight": "s-2.safetensors", "b.bias": "s-2.safetensors", "c": "s-2.safetensors"}}))
    with pytest.raises(GPT2PortError, match="keys listed but absent from their shards: a.weight"):
        open_weights(tmp_path / "s.safetensors.index.json")
