"""`finetune --lora-base-dtype bf16`: the frozen base's matrices held in bf16, computed in fp32 (gpt2port/lora/held.py).
Proven against the fp32 path at realistic scales: exactly the fp32 model of the bf16-rounded base, gradients within
the rounding's own effect of the fp32 base's, no fp32 copy of a matrix kept for the backward, and a run whose merged
checkpoint is the fp32 checkpoint plus the adapter (not the rounded base)."""

from __future__ import annotations

import json

import pytest
import torch

from gpt2port import GPT
from gpt2port.lora import held
from gpt2port.lora.peft import read_adapter
from tests.lora.helpers import ALL, ids, lora_model, rel
from tests.lora.test_lora_cli import args
from tests.support import assert_valid_checkpoint, run_cli
from tests.training.test_finetune import numbers, torchrun

# The bf16-held base against the fp32 one (measured at these scales: logits 2.0e-2, gradients 9.2e-2 of their
# tensor's largest, cosine >= 0.9973): bf16 keeps 8 bits of mantissa, and a trained-like base amplifies it.
LOGITS, GRADS, COSINE = 3e-2, 0.15, 0.995


def _logits_and_grads(model):
    model.train()
    x = ids()
    logits, loss = model(x, torch.roll(x, -1, 1))
    loss.backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _rounded(model):
    """The fp32 model whose frozen matrices are rounded to bf16 (what a held model computes)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if not p.requires_grad and p.dim() == 2 and n != "pos_emb.weight":
                p.copy_(p.bfloat16().float())
    return model


def test_held_base_computes_the_fp32_model_of_the_rounded_base_and_near_the_fp32_gradients(realistic_base):
    ckpt, _ = realistic_base
    model = lora_model(ckpt, ALL)
    matrices = sum(p.numel() for n, p in model.named_parameters() if not p.requires_grad and p.dim() == 2
                   and n != "pos_emb.weight")
    saved = held.hold_(model)
    assert saved == 2 * matrices  # half of 4 bytes per weight
    assert model.lm_head.weight is model.tok_emb.weight and model.tok_emb.weight.dtype == torch.bfloat16
    logits, grads = _logits_and_grads(model)
    ref_logits, ref = _logits_and_grads(_rounded(lora_model(ckpt, ALL)))
    assert rel(logits, ref_logits) <= 1e-6 and all(rel(grads[k], ref[k]) <= 1e-6 for k in ref)
    fp32_logits, fp32 = _logits_and_grads(lora_model(ckpt, ALL))
    assert 1e-4 < rel(logits, fp32_logits) <= LOGITS
    for k, g in fp32.items():
        assert rel(grads[k], g) <= GRADS, k
        assert torch.nn.functional.cosine_similarity(grads[k].flatten(), g.flatten(), 0) >= COSINE, k


def test_the_backward_keeps_no_fp32_copy_of_a_held_matrix(realistic_base):
    ckpt, _ = realistic_base
    model = lora_model(ckpt, ALL)
    held.hold_(model)
    shapes = {tuple(p.shape) for p in model.parameters() if p.dtype == torch.bfloat16}
    kept = []

    def pack(t):
        kept.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.train()(ids())[0].sum().backward()
    assert any(s in shapes and d == torch.bfloat16 for s, d in kept)  # held matrices are what is kept...
    assert not [s for s, d in kept if s in shapes and d == torch.float32]  # ...never an fp32 copy of one


@pytest.fixture(scope="module")
def bf16_run(realistic_base, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16-run") / "run"
    r = run_cli("finetune", *args(realistic_base[0], corpus, out, "--lora-base-dtype", "bf16"))
    assert r.exit_code == 0, r.output
    return out


def test_a_bf16_base_run_merges_into_the_fp32_checkpoint(bf16_run, lora_run, realistic_base):
    ckpt, out = realistic_base[0], bf16_run
    assert_valid_checkpoint(out)
    record = json.loads((out / "manifest.json").read_text())["saves"][-1]["finetune"]
    assert record["lora_merge_check"] <= 1e-5 and record["settings"]["lora_base_dtype"] == "bf16"
    tuned, base = GPT.from_pretrained(out).state_dict(), GPT.from_pretrained(ckpt).state_dict()
    deltas, _ = read_adapter(out / "adapter")
    for k, w in base.items():
        module = k.removesuffix(".weight")
        if module in deltas:  # the checkpoint's own fp32 weight plus the adapter
            a, b, scaling = deltas[module]
            assert rel(tuned[k], w + scaling * b @ a) <= 1e-6, k
        else:  # bit for bit the fp32 base, not its bf16 rounding
            assert torch.equal(tuned[k], w), k
    ours = [x["loss"] for x in map(json.loads, (out / "train_log.jsonl").read_text().splitlines()) if "loss" in x]
    fp32 = [x["loss"] for x in map(json.loads, (lora_run / "train_log.jsonl").read_text().splitlines()) if "loss" in x]
    assert len(ours) == len(fp32) and max(abs(a - b) / b for a, b in zip(ours, fp32)) <= 2e-2, (ours, fp32)


@pytest.mark.rehearsal  # the held base is one-process code under DDP: by default test_a_bf16_base_run_merges...
# and test_finetune.py's torchrun DDP test
def test_torchrun_ddp_with_a_bf16_base_trains_as_one_process(bf16_run, realistic_base, corpus, tmp_path):
    out = tmp_path / "run"
    torchrun(*args(realistic_base[0], corpus, out, "--lora-base-dtype", "bf16"))
    one, two = numbers(bf16_run), numbers(out)
    assert [s for s, _ in two] == [s for s, _ in one]
    for (_, a), (_, b) in zip(one, two):
        assert abs(a - b) <= 1e-4 * abs(a)
