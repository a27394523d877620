"""OpenAI's original TensorFlow checkpoints, read without TensorFlow. The fixtures under tests/fixtures/tf were
written by TensorFlow's own Saver (scripts/tf_fixtures.py), with weights.npz beside each: the same arrays as numpy
wrote them, the independent copy these tests compare against."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from gpt2port import GPT, convert
from gpt2port.formats.tf_bundle import TFBundleReader
from gpt2port.readers import open_weights
from tests.support import assert_clean_failure, leftovers, run_cli, snapshot
from tests.support import FIXTURES

FIXTURES = FIXTURES / "tf"


def npz(name: str = "tiny") -> dict[str, torch.Tensor]:
    with np.load(FIXTURES / name / "weights.npz") as f:
        return {k.replace(".", "/"): torch.from_numpy(f[k]) for k in f.files}


def hf_from_npz():
    """transformers' GPT2LMHeadModel holding the fixture's weights, mapped here by hand from OpenAI's names."""
    transformers = pytest.importorskip("transformers")
    hp = json.loads((FIXTURES / "tiny" / "hparams.json").read_text())
    config = transformers.GPT2Config(vocab_size=hp["n_vocab"], n_positions=hp["n_ctx"], n_embd=hp["n_embd"],
                                     n_layer=hp["n_layer"], n_head=hp["n_head"])
    model = transformers.GPT2LMHeadModel(config).eval()
    w, sd = npz(), {}
    sd["transformer.wte.weight"], sd["transformer.wpe.weight"] = w["model/wte"], w["model/wpe"]
    for i in range(hp["n_layer"]):
        for tf_name, hf_name in (("ln_1", "ln_1"), ("ln_2", "ln_2")):
            sd[f"transformer.h.{i}.{hf_name}.weight"] = w[f"model/h{i}/{tf_name}/g"]
            sd[f"transformer.h.{i}.{hf_name}.bias"] = w[f"model/h{i}/{tf_name}/b"]
        for part in ("attn/c_attn", "attn/c_proj", "mlp/c_fc", "mlp/c_proj"):
            key = part.replace("/", ".")
            sd[f"transformer.h.{i}.{key}.weight"] = w[f"model/h{i}/{part}/w"][0]  # [1, in, out] -> Conv1D (in, out)
            sd[f"transformer.h.{i}.{key}.bias"] = w[f"model/h{i}/{part}/b"]
    sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"] = w["model/ln_f/g"], w["model/ln_f/b"]
    sd["lm_head.weight"] = w["model/wte"]
    model.load_state_dict(sd, strict=False)
    return model


def test_the_reader_gives_tensorflows_bytes():
    for name in ("tiny", "sharded"):
        reader = TFBundleReader(FIXTURES / name / "model.ckpt.index")
        expected = npz(name)
        assert sorted(reader.tensors) == sorted(expected)
        for k, t in expected.items():
            assert torch.equal(reader.read(k), t), k
    assert len(TFBundleReader(FIXTURES / "sharded" / "model.ckpt.index").files) == 2


def test_the_bundle_is_bytes_and_openais_release_gives_it_a_meaning():
    """formats/tf_bundle.py reads TensorFlow's bytes and says nothing of GPT-2; readers/openai_tf.py gives the same
    bundle OpenAI's layout and the sizes of the hparams.json beside it."""
    index = FIXTURES / "tiny" / "model.ckpt.index"
    bundle = TFBundleReader(index)
    assert (bundle.layout, bundle.model_config, bundle.config_file) == (None, None, None)
    reader = open_weights(index)
    assert reader.layout == "openai-tf" and sorted(reader.tensors) == sorted(bundle.tensors)
    assert reader.model_config == {"vocab_size": 96, "n_positions": 24, "n_embd": 16, "n_head": 2, "n_layer": 2}
    assert reader.config_file == FIXTURES / "tiny" / "hparams.json" and reader.config_file in reader.inputs()


def test_converted_logits_equal_transformers_on_the_same_weights(tmp_path):
    out = convert(FIXTURES / "tiny", tmp_path / "ckpt").out
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = GPT.from_pretrained(out)(ids)[0], hf_from_npz()(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("given", ["tiny", "tiny/model.ckpt", "tiny/checkpoint", "tiny/model.ckpt.index",
                                   "sharded", "sharded/model.ckpt.data-00001-of-00002"])
def test_every_way_of_naming_the_checkpoint_gives_the_same_model(given, tmp_path):
    out = convert(FIXTURES / given, tmp_path / "ckpt").out
    got = load_file(out / "model.safetensors")
    w = npz()
    assert torch.equal(got["blocks.1.attn.qkv.weight"], w["model/h1/attn/c_attn/w"][0].t())
    assert torch.equal(got["tok_emb.weight"], w["model/wte"]) and len(got) == 4 + 12 * 2


def test_tf_to_gpt2port_to_hf_is_bit_exact(tmp_path):
    ckpt = convert(FIXTURES / "tiny", tmp_path / "ckpt").out
    assert run_cli("export", ckpt, "--to", "hf", "--out", tmp_path / "hf").exit_code == 0
    hf, w = load_file(tmp_path / "hf" / "model.safetensors"), npz()
    assert torch.equal(hf["transformer.h.0.mlp.c_fc.weight"], w["model/h0/mlp/c_fc/w"][0])
    assert torch.equal(hf["transformer.h.1.ln_2.bias"], w["model/h1/ln_2/b"])
    model = pytest.importorskip("transformers").GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert torch.equal(model.transformer.wte.weight, w["model/wte"])


def test_verify_against_the_tensorflow_files_as_reference(tmp_path):
    ckpt = convert(FIXTURES / "tiny", tmp_path / "ckpt").out
    r = run_cli("verify", ckpt, "--reference", FIXTURES / "tiny", "--no-hf", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["passed"] is True


def test_the_tokenizer_files_travel(tmp_path):
    from scripts.hf_fixtures import tokenizer_files

    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "tiny", src)
    files = tokenizer_files()
    shutil.copy(files["vocab.json"], src / "encoder.json")  # OpenAI's names for the same two files
    shutil.copy(files["merges.txt"], src / "vocab.bpe")
    out = convert(src, tmp_path / "ckpt").out
    assert {"encoder.json", "vocab.bpe"} <= {p.name for p in out.iterdir()}
    assert run_cli("info", out).exit_code == 0


def _corrupt(src: Path, how: str) -> str:
    """Damage a copy of the fixture; returns what the refusal must name."""
    data = src / "model.ckpt.data-00000-of-00001"
    index = src / "model.ckpt.index"
    if how == "flipped data byte":
        b = bytearray(data.read_bytes())
        b[len(b) // 2] ^= 0x40
        data.write_bytes(bytes(b))
        return "crc32c"
    if how == "truncated data file":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        return "truncated (tensor"
    if how == "damaged index block":
        b = bytearray(index.read_bytes())
        b[20] ^= 0x01
        index.write_bytes(bytes(b))
        return "crc32c"
    if how == "wrong magic":
        b = bytearray(index.read_bytes())
        b[-1] ^= 0xFF
        index.write_bytes(bytes(b))
        return "magic"
    if how == "missing shard":
        (src / "model.ckpt.data-00001-of-00002").unlink()
        return "missing data shard"
    if how == "hparams disagree":
        hp = json.loads((src / "hparams.json").read_text())
        (src / "hparams.json").write_text(json.dumps({**hp, "n_embd": 32}))
        return "hparams.json says width 32"
    if how == "non-float tensor":
        return "int32"
    raise ValueError(how)


@pytest.mark.parametrize("how", ["flipped data byte", "truncated data file", "damaged index block", "wrong magic",
                                 "missing shard", "hparams disagree", "non-float tensor"])
def test_damage_is_refused_in_one_line_with_sources_untouched(how, tmp_path):
    fixture = {"missing shard": "sharded", "non-float tensor": "nonfloat"}.get(how, "tiny")
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / fixture, src)
    named = _corrupt(src, how)
    before = snapshot(src)
    r = run_cli("convert", src, "--out", tmp_path / "out")
    assert named in assert_clean_failure(r)
    assert snapshot(src) == before
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_load_into_a_users_class_straight_from_the_tensorflow_directory(tmp_path):
    import gpt2port
    from gpt2port import GPTConfig

    ckpt = convert(FIXTURES / "tiny", tmp_path / "ckpt").out
    with gpt2port.init_empty():
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=96, n_positions=24))
    gpt2port.load_into(model, FIXTURES / "tiny")
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids)[0], GPT.from_pretrained(ckpt)(ids)[0])


@pytest.mark.parametrize("tensor", ["model/wte", "model/h0/mlp/c_fc/w"])
def test_a_flipped_byte_is_named_whether_the_tensor_streams_or_is_read_whole(tensor, tmp_path):
    """The token embedding goes from file to file in pieces (same bytes, same dtype), its crc32c carried across
    them; a kernel is read whole and transposed. Either way a flipped byte is refused naming the tensor."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "tiny", src)
    info = TFBundleReader(src / "model.ckpt.index").tensors[tensor]
    b = bytearray(info.file.read_bytes())
    b[info.offset + info.nbytes - 3] ^= 0x10
    info.file.write_bytes(bytes(b))
    r = run_cli("convert", src, "--out", tmp_path / "out")
    line = assert_clean_failure(r)
    assert "crc32c" in line and tensor in line, line
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_nan_in_a_streamed_tensor_is_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = convert(FIXTURES / "tiny", tmp_path / "hf", to="hf").out
    tensors = load_file(hf / "model.safetensors")
    key = next(k for k in tensors if k.endswith("wpe.weight"))
    tensors[key][3, 1] = float("nan")
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    result = convert(hf, tmp_path / "ckpt")
    assert any(key in w and "NaN" in w for w in result.warnings), result.warnings
