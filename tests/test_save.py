"""Saving a model from memory: from a torch.compile'd model, from bf16, with the parent named when the model was not
loaded from it; manifest.json names the parent's weights by sha256."""

from __future__ import annotations

import hashlib
import json

import torch

import gpt2port
from gpt2port import GPT
from gpt2port.checkpoint import load_state


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_compiled_model_saves_as_its_module(tiny_ckpt, tmp_path):
    compiled = torch.compile(GPT.from_pretrained(tiny_ckpt))
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())
    out = gpt2port.save(compiled, tmp_path / "c")
    assert (out / "model.safetensors").read_bytes() == (tiny_ckpt / "model.safetensors").read_bytes()


def test_bf16_model_saves_and_loads_back(tiny_ckpt, tmp_path):
    model = GPT.from_pretrained(tiny_ckpt).to(torch.bfloat16)
    out = model.save_pretrained(tmp_path / "b")
    back = GPT.from_pretrained(out)
    assert back.tok_emb.weight.dtype == torch.bfloat16
    assert json.loads((out / "manifest.json").read_text())["dtype"] == "bf16"
    ids = torch.randint(0, 50257, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(ids)[0], model(ids)[0])


def test_parent_names_where_a_model_came_from(tiny_ckpt, tmp_path):
    _, config, state = load_state(tiny_ckpt)
    model = GPT(config)  # built and filled by hand: it knows no checkpoint
    model.load_state_dict({**state, "lm_head.weight": state["tok_emb.weight"]})
    out = gpt2port.save(model, tmp_path / "p", parent=tiny_ckpt)
    assert (out / "vocab.json").is_file() and (out / "merges.txt").is_file()  # the parent's tokenizer
    saved = json.loads((out / "manifest.json").read_text())["saves"][-1]
    assert saved["from"] == str(tiny_ckpt.resolve())
    assert saved["from_weights"]["sha256"] == sha256(tiny_ckpt / "model.safetensors")


def test_a_loaded_model_records_its_parents_bytes(tiny_ckpt, tmp_path):
    out = GPT.from_pretrained(tiny_ckpt).save_pretrained(tmp_path / "l")
    saved = json.loads((out / "manifest.json").read_text())["saves"][-1]
    weights = tiny_ckpt / "model.safetensors"
    assert saved["from_weights"] == {"name": "model.safetensors", "size": weights.stat().st_size,
                                     "sha256": sha256(weights)}
