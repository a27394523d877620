"""`finetune --checkpoint-activations [N]` (gpt2port/training/recompute.py): the first N blocks recompute their
activations in the backward. Proven at realistic scales, for full fine-tuning and LoRA (a bf16-held base too): the
blocks really run twice, the losses and gradients are those without it bit for bit (dropout on), the module tree
and state_dict keys are unchanged; a run with it leaves the same checkpoint and adapter, --resume keeps it (a state
from before it resumes without it), DDP and FSDP run it, and what does not combine is refused in one line."""

from __future__ import annotations

import json
import signal

import pytest
import torch

from gpt2port import GPT
from gpt2port.lora import held
from gpt2port.training import recompute
from tests.lora.helpers import ALL, ids, lora_model
from tests.lora.test_lora_cli import args
from tests.support import assert_clean_failure, assert_valid_checkpoint, run_cli
from tests.training.test_finetune import numbers, stopped_run, torchrun


def _model(ckpt, kind: str):
    """The realistic base as a full fine-tune trains it (dropout on), or with trained-like adapters on all four
    matrices (bf16: the base held in bf16)."""
    if kind == "full":
        model = GPT.from_pretrained(ckpt, dtype=torch.float32)
        for b in model.blocks:  # dropout on: the recomputation must draw the masks the forward drew
            b.attn.dropout = 0.1
            b.attn.resid_dropout.p = b.mlp.dropout.p = 0.1
        return model
    model = lora_model(ckpt, ALL)
    if kind == "lora-bf16":
        held.hold_(model)
    return model


def _step(model):
    """Loss and every trained gradient of one training forward and backward, and how often each block started (its
    first LayerNorm: a recomputation stops once it has what the backward needs)."""
    runs = [0] * len(model.blocks)
    hooks = [b.ln1.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
             for i, b in enumerate(model.blocks)]
    model.train()
    x = ids(n_batch=2, T=32)
    torch.manual_seed(11)
    _, loss = model(x, torch.roll(x, -1, 1))
    loss.backward()  # a recomputed block runs its forward again here
    for h in hooks:
        h.remove()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, runs


@pytest.mark.parametrize("kind", ["full", "lora", "lora-bf16"])
@pytest.mark.parametrize("n", [3, 1])
def test_recomputed_blocks_give_the_same_loss_and_gradients_bit_for_bit(realistic_base, kind, n):
    ckpt = realistic_base[0]
    loss, grads, runs = _step(_model(ckpt, kind))
    model = _model(ckpt, kind)
    keys, modules = list(model.state_dict()), [(name, type(m)) for name, m in model.named_modules()]
    assert recompute.attach(model, n) == list(range(n)) == recompute.recomputed(model)
    assert list(model.state_dict()) == keys and [(name, type(m)) for name, m in model.named_modules()] == modules
    loss2, grads2, runs2 = _step(model)
    assert runs == [1, 1, 1] and runs2 == [2] * n + [1] * (3 - n)  # really recomputed, only where asked
    assert loss2.item() == loss.item() and grads2.keys() == grads.keys() and len(grads) > 0
    for k, g in grads.items():
        assert torch.equal(grads2[k], g), k


def test_a_run_with_checkpointing_leaves_the_same_checkpoint_and_adapter(lora_run, realistic_base,
                                                                          corpus, tmp_path):
    out = tmp_path / "run"
    r = run_cli("finetune", *[a for a in args(realistic_base[0], corpus, out) if a != "--quiet"],
                "--checkpoint-activations")
    assert r.exit_code == 0, r.output
    assert "activation checkpointing: every block recomputed in the backward" in r.stderr
    assert_valid_checkpoint(out)
    assert numbers(out) == numbers(lora_run)
    for f in ("model.safetensors", "adapter/adapter_model.safetensors"):
        assert (out / f).read_bytes() == (lora_run / f).read_bytes(), f
    record = json.loads((out / "manifest.json").read_text())["saves"][-1]["finetune"]
    assert record["settings"]["checkpoint_activations"] == 3  # bare: every block, saved as the count


@pytest.mark.rehearsal  # by default: test_recomputed_blocks_give_the_same_loss_and_gradients_bit_for_bit[full]
# (dropout on) and the LoRA run with the option above
def test_a_full_fine_tune_with_checkpointing_learns_the_same(realistic_base, corpus, tmp_path):
    full = ["--steps", "6", "--batch-size", "4", "--block-size", "32", "--lr", "1e-3", "--eval-every", "3",
            "--eval-windows", "4", "--dropout", "0.1", "--quiet"]
    runs = {}
    for name, more in (("plain", []), ("recomputed", ["--checkpoint-activations", "2"])):
        runs[name] = tmp_path / name
        r = run_cli("finetune", realistic_base[0], "--data", corpus, "--out", runs[name], *full, *more)
        assert r.exit_code == 0, r.output
    assert numbers(runs["plain"]) == numbers(runs["recomputed"])
    assert (runs["plain"] / "model.safetensors").read_bytes() == (runs["recomputed"] / "model.safetensors").read_bytes()


def test_resume_keeps_checkpointing_and_a_state_from_before_it_resumes_without(lora_run,
                                                                               realistic_base, corpus, tmp_path):
    for name, edit in (("kept", None), ("older", "checkpoint_activations")):
        out = tmp_path / name
        code, err = stopped_run(args(realistic_base[0], corpus, out, "--checkpoint-activations", "2"), out, 3,
                                signal.SIGINT)
        assert code == 130, err
        meta = out / "train_state" / "meta.json"
        saved = json.loads(meta.read_text())
        assert saved["settings"]["checkpoint_activations"] == 2
        if edit:  # as a state written before the setting existed
            del saved["settings"][edit]
            meta.write_text(json.dumps(saved))
        r = run_cli("finetune", *[a for a in args(realistic_base[0], corpus, out, "--resume") if a != "--quiet"])
        assert r.exit_code == 0, r.output
        assert ("activation checkpointing: the first 2 of 3 blocks" in r.stderr) == (edit is None), r.stderr
        record = json.loads((out / "manifest.json").read_text())["saves"][-1]["finetune"]
        assert record["settings"]["checkpoint_activations"] == (0 if edit else 2)
        assert numbers(out) == numbers(lora_run)


@pytest.mark.parametrize("extra,names", [
    (["--checkpoint-activations", "4"], ["--checkpoint-activations 4", "3"]),
    (["--checkpoint-activations", "--compile"], ["--checkpoint-activations", "--compile"]),
])
def test_bad_checkpointing_options_are_refused_in_one_line(realistic_base, corpus, tmp_path, extra, names):
    out = tmp_path / "run"
    r = run_cli("finetune", realistic_base[0], "--data", corpus, "--out", out, "--steps", "1", "--batch-size", "2",
                "--block-size", "16", "--eval-every", "0", "--quiet", *extra)
    assert_clean_failure(r, names)
    assert not out.exists()


@pytest.mark.parametrize("value", [-2, True, 1.5])
def test_bad_checkpointing_values_from_python_are_refused(realistic_base, corpus, tmp_path, value):
    from gpt2port.errors import GPT2PortError
    from gpt2port.training.finetune import Settings, finetune

    with pytest.raises(GPT2PortError, match=f"^--checkpoint-activations {value}: .*between 0 and the model's 3"):
        finetune(realistic_base[0], corpus, tmp_path / "run", Settings(steps=1, checkpoint_activations=value))
    assert not (tmp_path / "run").exists()


def test_a_saved_state_with_a_bad_checkpointing_value_is_refused_in_one_line(realistic_base, corpus, tmp_path):
    out = tmp_path / "run"
    code, err = stopped_run(args(realistic_base[0], corpus, out), out, 3, signal.SIGINT)
    assert code == 130, err
    meta = out / "train_state" / "meta.json"
    saved = json.loads(meta.read_text())
    saved["settings"]["checkpoint_activations"] = True
    meta.write_text(json.dumps(saved))
    before = meta.read_bytes()
    assert_clean_failure(run_cli("finetune", *args(realistic_base[0], corpus, out, "--resume")),
                         ["meta.json", "checkpoint_activations"])
    assert meta.read_bytes() == before


@pytest.mark.rehearsal  # dist.build attaches the recomputation before it wraps or shards, in every mode: by default
# the one-process run with it above, and the torchrun tests of test_finetune.py and test_lora_cli.py
@pytest.mark.parametrize("fsdp", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_torchrun_with_checkpointing_trains_as_one_process(lora_run, realistic_base, corpus, tmp_path,
                                                          fsdp):
    out = tmp_path / "run"
    torchrun(*args(realistic_base[0], corpus, out, "--checkpoint-activations", *fsdp))
    assert_valid_checkpoint(out)
    one, two = numbers(lora_run), numbers(out)
    assert [s for s, _ in two] == [s for s, _ in one]
    for (_, a), (_, b) in zip(one, two):
        assert abs(a - b) <= 1e-4 * abs(a)
