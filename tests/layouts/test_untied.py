"""A head of its own (format gpt2port/v2): read from an untied HF checkpoint, kept through convert, export, verify
and save; refused where a format has no place for it. Checkpoints written by the previous version (v1, committed
under tests/fixtures) still load with the same logits. And save_from: a user's class back out, bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import gpt2port
from gpt2port import GPT
from gpt2port.checkpoint import load_state
from scripts import hf_fixtures
from gpt2port.config import GPTConfig
from tests.conftest import TINY
from tests.userclasses import Case
from tests.support import assert_clean_failure, run_cli
from tests.support import FIXTURES

V = TINY["vocab_size"]
CONFIG = GPTConfig(**TINY)


def tag(ckpt: Path) -> str:
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        return f.metadata()["gpt2port_format"]


@pytest.fixture(scope="module")
def untied_hf(tmp_path_factory):
    """transformers' GPT-2 with tie_word_embeddings=False and a head that differs from wte."""
    model = hf_fixtures.make_hf_model(hf_fixtures.hf_config(TINY, tie_word_embeddings=False), seed=5)
    with torch.no_grad():
        model.lm_head.weight.add_(0.05 * torch.randn_like(model.lm_head.weight))
    assert not torch.equal(model.lm_head.weight, model.transformer.wte.weight)
    out = tmp_path_factory.mktemp("untied-hf")
    model.save_pretrained(out)
    for name, path in hf_fixtures.tokenizer_files().items():
        shutil.copy(path, out / name)
    return out, model


@pytest.fixture(scope="module")
def untied_ckpt(untied_hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("untied") / "ckpt"
    gpt2port.convert(untied_hf[0], out)
    return out


def ids_of(T=20):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(11))


def test_untied_hf_converts_to_v2_and_computes_its_head(untied_hf, untied_ckpt):
    assert tag(untied_ckpt) == "gpt2port/v2"
    assert json.loads((untied_ckpt / "config.json").read_text())["model"]["tie_word_embeddings"] is False
    ours = GPT.from_pretrained(untied_ckpt)
    assert ours.lm_head.weight is not ours.tok_emb.weight
    ids = ids_of()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[0], untied_hf[1](ids).logits, rtol=1e-5, atol=1e-5)
    r = run_cli("info", untied_ckpt)
    assert "lm_head (untied)" in r.output


def test_tied_checkpoints_are_still_v1(tiny_ckpt):
    assert tag(tiny_ckpt) == "gpt2port/v1"
    assert "lm_head.weight" not in load_file(str(tiny_ckpt / "model.safetensors"))
    assert "tie_word_embeddings" not in (tiny_ckpt / "config.json").read_text()  # as v1 wrote it


def test_export_hf_writes_the_head_transformers_loads(untied_hf, untied_ckpt, tmp_path):
    from transformers import GPT2LMHeadModel

    gpt2port.export(untied_ckpt, tmp_path / "hf", to="hf")
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert back.lm_head.weight.data_ptr() != back.transformer.wte.weight.data_ptr()
    ids = ids_of()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, untied_hf[1](ids).logits, rtol=1e-5, atol=1e-5)


def test_llmc_has_no_place_for_an_untied_head(untied_ckpt, tmp_path):
    r = run_cli("export", untied_ckpt, "--to", "llmc", "--out", tmp_path / "llmc")
    assert_clean_failure(r, names=["llmc", "untied"])
    assert not (tmp_path / "llmc").exists()


def test_verify_passes_on_an_untied_checkpoint(untied_ckpt):
    report = gpt2port.verify(untied_ckpt, tokens=16)
    assert report.passed, report.to_text()


def test_previous_version_checkpoint_still_loads_with_its_logits():
    """tests/fixtures/v1-checkpoint was written by gpt2port 0.1.0 (the format before v2), and its logits on fixed
    ids by that version's GPT, in v1-checkpoint-expected.safetensors."""
    expected = load_file(str(FIXTURES / "v1-checkpoint-expected.safetensors"))
    model = GPT.from_pretrained(FIXTURES / "v1-checkpoint")
    assert model.lm_head.weight is model.tok_emb.weight
    with torch.no_grad():
        # Not bit for bit: the expected logits were computed on another CPU, and CPUs with different vector units
        # get different matmul kernels, whose summation order differs in the last bit (measured: 6e-8 at most). A
        # checkpoint that loaded wrongly (a missed transpose, a lost bias, a swapped tensor) is off by ~1.
        torch.testing.assert_close(model(expected["ids"])[0], expected["logits"], rtol=1e-5, atol=1e-6)


# --- save_from ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [Case("lecture", {"bias": True, "act": "gelu_tanh"}), Case("anonymous"),
                                  Case("conv1d_style")], ids=lambda c: c.id)
def test_checkpoint_to_class_to_save_from_is_bit_exact(case, tiny_ckpt, tmp_path):
    """Per-head parts, names settled by numbers, raw (in, out) weights: each goes back through its inverse.
    (syds, llms, mingpt, opaque: test_load_into.py.)"""
    model = case.build(CONFIG)
    gpt2port.load_into(model, tiny_ckpt)
    out = gpt2port.save_from(model, tmp_path / "back")
    assert tag(out) == "gpt2port/v1"  # the untied heads still equal the embedding: stored once, as GPT-2 does
    a, b = load_file(str(tiny_ckpt / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert (out / "vocab.json").is_file()  # the tokenizer travels with it


def test_a_fine_tuned_untied_head_is_kept_not_retied(tiny_ckpt, tmp_path):
    model = Case("syds").build(CONFIG)
    gpt2port.load_into(model, tiny_ckpt)
    with torch.no_grad():
        model.output_projection.weight[7] += 1.0
    out = gpt2port.save_from(model, tmp_path / "tuned")
    assert tag(out) == "gpt2port/v2"
    back = GPT.from_pretrained(out)
    ids = ids_of()
    with torch.no_grad():
        torch.testing.assert_close(back(ids)[0], model(ids), rtol=1e-5, atol=1e-5)
    assert torch.equal(back.lm_head.weight, model.output_projection.weight)
    gpt2port.export(out, tmp_path / "hf", to="hf")  # and on to transformers, head and all
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-5, atol=1e-5)


def test_a_trained_head_bias_is_refused(tiny_ckpt, tmp_path):
    model = Case("opaque").build(CONFIG)
    gpt2port.load_into(model, tiny_ckpt)
    with torch.no_grad():
        model.lm_head.bias[0] = 0.5
    with pytest.raises(gpt2port.GPT2PortError, match="lm_head.bias: is no longer zero"):
        gpt2port.save_from(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_save_from_a_cropped_class_is_the_gpt2_it_is(tiny_ckpt, tmp_path):
    model = Case("syds").build(CONFIG, block_size=32)
    gpt2port.load_into(model, tiny_ckpt, crop_positions=True)
    out = gpt2port.save_from(model, tmp_path / "short")
    assert json.loads((out / "config.json").read_text())["model"]["n_positions"] == 32
    assert torch.equal(load_state(out)[2]["pos_emb.weight"], load_state(tiny_ckpt)[2]["pos_emb.weight"][:32])


def test_gguf_gets_the_head_as_output_weight(untied_ckpt, tmp_path):
    gguf = pytest.importorskip("gguf")
    from gpt2port.targets.gguf import FILE_NAME

    gpt2port.export(untied_ckpt, tmp_path / "g", to="gguf", options={"output_tensor": True})  # written once
    tensors = {}
    for t in gguf.GGUFReader(tmp_path / "g" / FILE_NAME).tensors:
        assert t.name not in tensors, t.name
        tensors[t.name] = t
    head = load_state(untied_ckpt)[2]["lm_head.weight"]
    assert torch.equal(torch.from_numpy(tensors["output.weight"].data.copy()).reshape(head.shape), head)
