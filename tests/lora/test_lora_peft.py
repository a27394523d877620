"""gpt2port's LoRA against peft's, in numbers, on realistic-scale weights: merged = unmerged; peft over the base's
`export --to hf` with gpt2port's adapter computes gpt2port's logits; both give the same gradients on one batch;
an adapter peft saved merges here into what peft computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpt2port import GPT
from gpt2port.lora import layer
from gpt2port.lora.peft import read_adapter, write_adapter
from tests.lora.helpers import ALL, ids, lora_model, rel

peft = pytest.importorskip("peft")
TOL = 1e-5
SHAPES = [pytest.param(ALL, False, id="all-four"), pytest.param(("qkv",), False, id="qkv"),
          pytest.param(("qkv", "fc"), True, id="split-qkv+fc")]


def peft_model(hf_dir, adapter, trainable=False):
    from transformers import GPT2LMHeadModel

    # no dropout, as gpt2port's fine-tuning defaults to (the export's config.json keeps GPT-2's 0.1)
    base = GPT2LMHeadModel.from_pretrained(hf_dir, torch_dtype=torch.float32, resid_pdrop=0.0, embd_pdrop=0.0,
                                           attn_pdrop=0.0)
    return peft.PeftModel.from_pretrained(base, str(adapter), is_trainable=trainable)


def save_ours(model, where):
    where.mkdir()
    write_adapter(where, layer.deltas_of(model), "base")
    return where


@pytest.mark.parametrize("targets,split", SHAPES)
def test_merged_equals_unmerged(realistic_base, targets, split):
    ckpt, _ = realistic_base
    model = lora_model(ckpt, targets, split_qkv=split)
    x = ids()
    with torch.no_grad():
        before = layer.logits_of(model, x)
        base = layer.logits_of(GPT.from_pretrained(ckpt), x)
        assert rel(before, base) > 1e-2  # the adapters do move the logits: the comparison below can fail
        layer.merge_(model)
        assert not layer.adapted(model) and isinstance(model.blocks[0].attn.qkv, torch.nn.Linear)
        assert rel(layer.logits_of(model, x), before) <= TOL


@pytest.mark.parametrize("targets,split", SHAPES)
def test_peft_loads_our_adapter_and_computes_our_logits(realistic_base, tmp_path, targets, split):
    ckpt, hf_dir = realistic_base
    model = lora_model(ckpt, targets, split_qkv=split)
    x = ids()
    theirs = peft_model(hf_dir, save_ours(model, tmp_path / "adapter")).eval()
    with torch.no_grad():
        ours = layer.logits_of(model, x)
        assert rel(theirs(x).logits, ours) <= TOL
        assert rel(ours, layer.logits_of(GPT.from_pretrained(ckpt), x)) > 1e-2


@pytest.mark.parametrize("targets,split", SHAPES)
def test_gradients_equal_peft(realistic_base, tmp_path, targets, split):
    ckpt, hf_dir = realistic_base
    model = lora_model(ckpt, targets, split_qkv=split)
    theirs = peft_model(hf_dir, save_ours(model, tmp_path / "adapter"), trainable=True)
    model.train(), theirs.train()  # dropout is 0: train mode changes nothing but is what training runs
    full = ids(T=25)
    x, y = full[:, :-1], full[:, 1:]
    _, loss = model(x, y)
    loss.backward()
    their_loss = F.cross_entropy(theirs(x).logits.flatten(0, 1), y.flatten())
    their_loss.backward()
    assert abs(loss.item() - their_loss.item()) <= TOL * abs(loss.item())
    grads = dict(theirs.named_parameters())
    n = 0
    for name, m in layer.adapted(model).items():
        i, module = name.split(".", 2)[1:]
        hf = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc",
              "mlp.proj": "mlp.c_proj"}[module]
        ga = grads[f"base_model.model.transformer.h.{i}.{hf}.lora_A.default.weight"].grad
        gb = grads[f"base_model.model.transformer.h.{i}.{hf}.lora_B.default.weight"].grad
        # split q|k|v: peft holds them as one rank-3r adapter (A stacked, B block-diagonal); its A's gradient is
        # the three A's, and the diagonal blocks of its B's gradient are the three B's
        assert rel(m.lora_A.grad.flatten(0, 1), ga) <= TOL
        out, r = m.lora_B.shape[1:]
        for p in range(m.parts):
            assert rel(m.lora_B.grad[p], gb[p * out:(p + 1) * out, p * r:(p + 1) * r]) <= TOL
        assert m.lora_B.grad.abs().max() > 0 and m.lora_A.grad.abs().max() > 0
        n += 1
    assert n == 3 * len(targets)
    assert all(p.grad is None for n_, p in model.named_parameters() if "lora_" not in n_)  # the base is frozen


def test_peft_adapter_merges_to_peft_logits(realistic_base, tmp_path):
    """An adapter made by peft itself (its own init and save_pretrained, rank_pattern and alpha_pattern), merged by
    gpt2port's merge, computes what peft computes with it."""
    from transformers import GPT2LMHeadModel

    from gpt2port.lora.merge import merge

    ckpt, hf_dir = realistic_base
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True,
                             rank_pattern={"c_fc": 2}, alpha_pattern={"attn.c_proj": 3.0}, init_lora_weights=False)
    torch.manual_seed(0)
    theirs = peft.get_peft_model(GPT2LMHeadModel.from_pretrained(hf_dir, torch_dtype=torch.float32), config).eval()
    theirs.save_pretrained(tmp_path / "adapter")
    out, diff = merge(ckpt, tmp_path / "adapter", tmp_path / "merged")
    assert diff <= TOL
    x = ids()
    with torch.no_grad():
        want = theirs(x).logits
        assert rel(want, layer.logits_of(GPT.from_pretrained(ckpt), x)) > 1e-2
        assert rel(layer.logits_of(GPT.from_pretrained(out), x), want) <= TOL
    deltas, _ = read_adapter(tmp_path / "adapter")
    assert {a.shape[0] for n, (a, _, _) in deltas.items() if n.endswith("mlp.fc")} == {2}
    assert {s for n, (_, _, s) in deltas.items() if n.endswith("attn.proj")} == {3.0 / 4}
