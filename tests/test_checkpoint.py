"""Saving a model from memory: the same writer as conversion, byte-exact with the checkpoint it was loaded from."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import gpt2port
from gpt2port import GPT, GPTConfig
from click.testing import CliRunner

from gpt2port.checkpoint import read_manifest, resolve
from gpt2port.cli import main
from gpt2port.errors import GPT2PortError

WEIGHTS = "model.safetensors"


def test_saving_an_unchanged_model_reproduces_its_checkpoint_byte_for_byte(tiny_ckpt, tmp_path):
    model = GPT.from_pretrained(tiny_ckpt)
    out = model.save_pretrained(tmp_path / "again")
    assert (out / WEIGHTS).read_bytes() == (tiny_ckpt / WEIGHTS).read_bytes()
    assert (out / "config.json").read_bytes() == (tiny_ckpt / "config.json").read_bytes()
    for name in ("vocab.json", "merges.txt"):
        assert (out / name).read_bytes() == (tiny_ckpt / name).read_bytes()
    manifest = read_manifest(out)
    assert manifest["source"] == read_manifest(tiny_ckpt)["source"]  # provenance carried over
    assert manifest["saves"][-1]["from"] == str(tiny_ckpt.resolve())


def test_a_changed_model_saves_and_loads_back_exactly(tiny_ckpt, tmp_path):
    model = GPT.from_pretrained(tiny_ckpt)
    with torch.no_grad():
        model.blocks[1].mlp.fc.weight.mul_(1.5)
        model.tok_emb.weight[7].fill_(0.25)  # the head is the embedding: one change, seen by both
    gpt2port.save(model, tmp_path / "tuned")
    back = GPT.from_pretrained(tmp_path / "tuned")
    for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    assert back.lm_head.weight is back.tok_emb.weight
    ids = torch.tensor([[464, 3290, 7]])
    with torch.no_grad():
        assert torch.equal(model(ids)[0], back(ids)[0])
    # the checkpoint it was loaded from is untouched
    assert not torch.equal(GPT.from_pretrained(tiny_ckpt).blocks[1].mlp.fc.weight, model.blocks[1].mlp.fc.weight)


def test_a_model_built_from_scratch_saves_in_another_dtype(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=100, n_positions=8))
    gpt2port.save(model, tmp_path / "scratch", dtype="bf16")
    back = GPT.from_pretrained(tmp_path / "scratch")
    assert back.tok_emb.weight.dtype == torch.bfloat16
    assert torch.equal(back.blocks[0].attn.qkv.weight, model.blocks[0].attn.qkv.weight.to(torch.bfloat16))
    manifest = json.loads((tmp_path / "scratch" / "manifest.json").read_text())
    assert manifest["dtype"] == "bf16" and manifest["source"]["kind"] == "in-memory GPT"


def test_save_refuses_an_untied_head_and_a_place_inside_its_checkpoint(tiny_ckpt, tmp_path):
    model = GPT.from_pretrained(tiny_ckpt)
    with pytest.raises(GPT2PortError, match="inside/around"):
        model.save_pretrained(tiny_ckpt / "nested")
    model.lm_head.weight = torch.nn.Parameter(model.tok_emb.weight.detach() + 1)
    with pytest.raises(GPT2PortError, match="no longer tied"):
        model.save_pretrained(tmp_path / "untied")
    assert not (tmp_path / "untied").exists()


def test_saving_over_its_own_checkpoint_with_force(tiny_ckpt, tmp_path):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    model = GPT.from_pretrained(ckpt)
    with torch.no_grad():
        model.final_norm.bias.add_(1.0)
    with pytest.raises(GPT2PortError, match="already exists"):
        model.save_pretrained(ckpt)
    model.save_pretrained(ckpt, force=True)
    assert torch.equal(GPT.from_pretrained(ckpt).final_norm.bias, model.final_norm.bias)


def test_a_name_under_the_checkpoints_folder_resolves_and_a_miss_lists_it(tmp_path, tiny_ckpt, monkeypatch):
    """`download org/tiny-sharded` writes checkpoints/tiny-sharded and `--out checkpoints/gpt2-again` what it says:
    `info tiny-sharded` and `info gpt2-again` must find them from any directory; a name that is not there is
    refused with the folder's contents, so the user sees what they could have meant."""
    folder = tmp_path / "ckpts"
    monkeypatch.setenv("GPT2PORT_CHECKPOINTS", str(folder))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(GPT2PortError, match=r"no such checkpoint directory \(.*ckpts does not exist yet\)"):
        resolve("tiny-sharded")
    for name in ("tiny-sharded", "gpt2-again"):
        shutil.copytree(tiny_ckpt, folder / name)
    (folder / "not-a-checkpoint").mkdir()
    assert resolve("tiny-sharded") == folder / "tiny-sharded"
    assert resolve("gpt2port-fixtures/tiny-sharded") == folder / "tiny-sharded"  # the repo id download was given
    assert resolve("gpt2-again") == folder / "gpt2-again"
    r = CliRunner().invoke(main, ["info", "gpt2-again"])
    assert r.exit_code == 0 and "gpt2-again" in r.output, r.output
    with pytest.raises(GPT2PortError) as miss:
        resolve("gpt2-agian")
    assert str(miss.value) == (f"gpt2-agian: no such checkpoint directory; did you mean 'gpt2-again'? "
                               f"({folder} holds: gpt2-again, tiny-sharded)")
    with pytest.raises(GPT2PortError, match=r"run `gpt2port download gpt2`; .*holds: gpt2-again, tiny-sharded"):
        resolve("gpt2")  # an official name not downloaded yet: the command, and what is there instead
    with pytest.raises(GPT2PortError, match="no such checkpoint directory"):
        resolve(tmp_path / "elsewhere" / "tiny-sharded")  # an explicit path is taken as it is
    (tmp_path / "runs").mkdir()
    with pytest.raises(GPT2PortError, match="no such checkpoint directory"):
        resolve("runs/gpt2-again")  # a path under a directory that is here: not found there, not taken elsewhere
