"""`gpt2port finetune --lora`, `gpt2port merge` and `gpt2port export ADAPTER --to gguf` end to end: what a LoRA run
leaves (an adapter peft loads, a merged checkpoint that computes base + adapter, a train_state of adapters only),
that it resumes bit for bit, and that bad input is refused in one line with nothing written."""

from __future__ import annotations

import json
import shutil
import signal

import pytest
import torch

from gpt2port import GPT
from gpt2port.fsio import check_replaceable
from gpt2port.lora import layer
from gpt2port.lora.peft import read_adapter
from tests.lora.helpers import ids, lora_model, rel
from tests.support import assert_clean_failure, assert_valid_checkpoint, run_cli, snapshot
from tests.training.test_finetune import numbers, rows, stopped_run, torchrun

LORA = ["--lora", "4", "--lora-alpha", "8", "--lora-targets", "qkv,attn_proj,fc,mlp_proj"]
RUN = ["--steps", "12", "--save-every", "4", "--batch-size", "8", "--block-size", "32", "--lr", "1e-2",
       "--eval-every", "6", "--eval-windows", "8", "--quiet"]


def args(ckpt, corpus, out, *more):
    return [ckpt, "--data", corpus, "--out", out, *RUN, *LORA, *more]


def test_a_lora_run_leaves_a_merged_checkpoint_and_a_peft_adapter(lora_run, realistic_base):
    peft = pytest.importorskip("peft")
    from transformers import GPT2LMHeadModel

    ckpt, hf_dir = realistic_base
    evals = [r["eval_loss"] for r in rows(lora_run) if "eval_loss" in r]
    assert evals[-1] < evals[0] - 0.1, evals
    assert_valid_checkpoint(lora_run)
    assert not (lora_run / "train_state").exists()
    check_replaceable(lora_run)  # a finished LoRA run is gpt2port's: --force may start it over
    config = json.loads((lora_run / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["fan_in_fan_out"]) == (4, 8.0, True)
    assert config["target_modules"] == ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    record = json.loads((lora_run / "manifest.json").read_text())["saves"][-1]["finetune"]
    assert record["lora_merge_check"] <= 1e-5 and record["settings"]["lora"] == 4
    tuned, base = GPT.from_pretrained(lora_run).state_dict(), GPT.from_pretrained(ckpt).state_dict()
    adapted = {k for k in base if k.endswith(("qkv.weight", "proj.weight", "fc.weight"))}
    assert all(torch.equal(tuned[k], base[k]) for k in base if k not in adapted)  # the base was frozen
    assert all(not torch.equal(tuned[k], base[k]) for k in adapted)
    hf = GPT2LMHeadModel.from_pretrained(hf_dir, torch_dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(hf, str(lora_run / "adapter")).eval()
    x = ids()
    with torch.no_grad():
        merged = layer.logits_of(GPT.from_pretrained(lora_run), x)
        assert rel(theirs(x).logits, merged) <= 1e-5
        assert rel(merged, layer.logits_of(GPT.from_pretrained(ckpt), x)) > 1e-3


def test_gpt2port_merge_of_the_run_adapter_gives_the_run_checkpoint(lora_run, realistic_base, tmp_path):
    r = run_cli("merge", realistic_base[0], lora_run / "adapter", "--out", tmp_path / "merged")
    assert r.exit_code == 0, r.output
    x = ids()
    with torch.no_grad():
        assert rel(layer.logits_of(GPT.from_pretrained(tmp_path / "merged"), x),
                   layer.logits_of(GPT.from_pretrained(lora_run), x)) <= 1e-6
    again = run_cli("merge", realistic_base[0], lora_run / "adapter", "--out", tmp_path / "merged")
    assert_clean_failure(again, ["--force"])
    assert run_cli("merge", realistic_base[0], lora_run / "adapter", "--out", tmp_path / "merged",
                   "--force").exit_code == 0
    # info says which adapter a merged checkpoint holds (its manifest records it), and a LoRA run that it has one
    shown = run_cli("info", tmp_path / "merged").stdout
    assert f"merged      the LoRA adapter {(lora_run / 'adapter').resolve()} (" in shown, shown
    assert "LoRA rank 4 merged (its adapter: adapter/)" in run_cli("info", lora_run).stdout


def test_merge_never_replaces_its_base_and_refuses_an_adapter_already_in_it(lora_run, realistic_base, tmp_path):
    """merge counts its base among the files it reads: --out BASE --force is refused, the base intact; an adapter
    that the base's manifest records as merged into it (by merge, or by the LoRA run that made it) is refused."""
    base = tmp_path / "base"
    shutil.copytree(realistic_base[0], base)
    before = snapshot(base)
    line = assert_clean_failure(run_cli("merge", base, lora_run / "adapter", "--out", base, "--force"), [str(base)])
    assert "base checkpoint" in line, line
    assert snapshot(base) == before
    merged = tmp_path / "merged"
    assert run_cli("merge", base, lora_run / "adapter", "--out", merged).exit_code == 0
    for already in (merged, lora_run):
        line = assert_clean_failure(run_cli("merge", already, lora_run / "adapter", "--out", tmp_path / "twice"),
                                    [str(lora_run / "adapter")])
        assert f"already merged into {already}" in line, line
        assert not (tmp_path / "twice").exists()


def test_a_runs_adapter_edited_is_refused_by_force(lora_run, tmp_path):
    """The adapter of a LoRA run is in the run's record: a raised lora_alpha makes the run no longer gpt2port's."""
    from gpt2port.errors import GPT2PortError

    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    check_replaceable(run)
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    config["lora_alpha"] *= 2
    (run / "adapter" / "adapter_config.json").write_text(json.dumps(config, indent=2))
    with pytest.raises(GPT2PortError, match=r"did not write \(adapter/adapter_config.json \("):
        check_replaceable(run)


def test_ctrl_c_then_resume_gives_the_uninterrupted_lora_run(lora_run, realistic_base, corpus, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    out = tmp_path / "run"
    code, err = stopped_run(args(realistic_base[0], corpus, out), out, 3, signal.SIGINT)
    assert code == 130, err
    saved = FileSystemReader(str(out / "train_state")).read_metadata().state_dict_metadata
    model_keys = {k.split(".", 1)[1] for k in saved if k.startswith("model.")}
    assert model_keys and all(k.endswith(("lora_A", "lora_B")) for k in model_keys)  # adapters only, no base
    refused = run_cli("finetune", *args(realistic_base[0], corpus, out, "--resume", "--lora", "8"))
    assert_clean_failure(refused, ["--lora 8"])
    r = run_cli("finetune", *args(realistic_base[0], corpus, out, "--resume"))
    assert r.exit_code == 0, r.output
    assert numbers(out) == numbers(lora_run)
    for f in ("model.safetensors", "adapter/adapter_model.safetensors"):
        assert (out / f).read_bytes() == (lora_run / f).read_bytes(), f


@pytest.mark.parametrize("extra,names", [
    (["--lora", "0"], ["--lora 0"]),
    (["--lora", "33"], ["--lora 33", "attn.qkv", "32"]),
    (["--lora", "12", "--lora-split-qkv", "--lora-targets", "qkv"], []),  # fits: 12 <= 32 per q, k, v
    (["--lora", "4", "--lora-targets", "qkv,q_proj"], ["q_proj"]),
    (["--lora-alpha", "16"], ["--lora-alpha", "--lora"]),
    (["--lora", "4", "--lora-dropout", "1.5"], ["--lora-dropout"]),
    (["--lora", "4", "--lora-split-qkv", "--lora-targets", "fc"], ["--lora-split-qkv"]),
    (["--lora-base-dtype", "bf16"], ["--lora-base-dtype", "--lora"]),
])
def test_bad_lora_options_are_refused_in_one_line(realistic_base, corpus, tmp_path, extra, names):
    out = tmp_path / "run"
    r = run_cli("finetune", realistic_base[0], "--data", corpus, "--out", out, "--steps", "1", "--batch-size", "2",
                "--block-size", "16", "--eval-every", "0", "--quiet", *extra)
    if not names:
        assert r.exit_code == 0, r.output
        return
    assert_clean_failure(r, names)
    assert not out.exists()


def test_lora_bf16_base_with_fsdp_is_refused_in_one_line(realistic_base, corpus, tmp_path):
    r = run_cli("finetune", realistic_base[0], "--data", corpus, "--out", tmp_path / "run", "--lora", "4", "--fsdp",
                "--lora-base-dtype", "bf16")
    assert_clean_failure(r, ["--lora-base-dtype", "--fsdp"])
    assert not (tmp_path / "run").exists()


# ddp: a rehearsal (dist.build has no LoRA branch for DDP: the one-process LoRA run and test_finetune.py's torchrun
# DDP test check its two halves); fsdp: by default (LoRA's own branch, the adapters made on the meta model)
@pytest.mark.parametrize("fsdp", [pytest.param([], marks=pytest.mark.rehearsal), ["--fsdp"]], ids=["ddp", "fsdp"])
def test_torchrun_lora_trains_as_one_process(lora_run, realistic_base, corpus, tmp_path, fsdp):
    out = tmp_path / "run"
    torchrun(*args(realistic_base[0], corpus, out, *fsdp))
    assert_valid_checkpoint(out)
    one, two = numbers(lora_run), numbers(out)
    assert [s for s, _ in two] == [s for s, _ in one]
    for (_, a), (_, b) in zip(one, two):
        assert abs(a - b) <= 1e-4 * abs(a)
    a, b = read_adapter(lora_run / "adapter")[0], read_adapter(out / "adapter")[0]
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name][1], a[name][1], rtol=1e-3, atol=1e-4)
    assert json.loads((out / "manifest.json").read_text())["saves"][-1]["finetune"]["lora_merge_check"] <= 1e-5
    with torch.no_grad():  # the merged checkpoint: the one process's, to the adapters' agreement
        x = ids()
        assert rel(layer.logits_of(GPT.from_pretrained(out), x), layer.logits_of(GPT.from_pretrained(lora_run), x)) \
            <= 1e-4


@pytest.mark.heavy
def test_an_fsdp_lora_run_stopped_by_its_launcher_resumes_on_one_process(lora_run, realistic_base, corpus, tmp_path):
    """SIGTERM to torchrun --fsdp: the sharded adapters and their AdamW state are saved, and --resume on one process
    (the state resharded) gives the uninterrupted one-process run's numbers."""
    import os
    import subprocess
    import sys
    import tempfile

    from tests.support import ROOT, interruptible
    from tests.training.test_finetune import wait_for_step

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "gpt2port",
           "finetune", *map(str, args(realistic_base[0], corpus, out, "--fsdp"))]
    with tempfile.TemporaryDirectory(prefix="torchrun-") as tmp:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": tmp},
                                **interruptible(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        wait_for_step(out, 5, proc, timeout=300)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    assert "stopped after step" in err, err[-5000:]
    assert 5 <= json.loads((out / "train_state" / "meta.json").read_text())["step"] < 12, err[-5000:]
    r = run_cli("finetune", *args(realistic_base[0], corpus, out, "--resume"))
    assert r.exit_code == 0, r.output
    for (s1, a), (s2, b) in zip(numbers(lora_run), numbers(out), strict=True):
        assert s1 == s2 and abs(a - b) <= 1e-4 * abs(a)


def _peft_adapter(where, hf_dir=None, **config):
    """An adapter saved by peft itself, on the base's HF export or (hf_dir None) on another GPT-2's."""
    peft = pytest.importorskip("peft")
    from transformers import GPT2LMHeadModel

    from scripts.hf_fixtures import TINY, hf_config, make_hf_model

    base = GPT2LMHeadModel.from_pretrained(hf_dir) if hf_dir else make_hf_model(hf_config({**TINY, "n_embd": 64}))
    cfg = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"], "fan_in_fan_out": True, **config}
    peft.get_peft_model(base, peft.LoraConfig(**cfg)).save_pretrained(where)
    return where


def _edit_config(adapter, **changes):
    path = adapter / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return adapter


@pytest.mark.parametrize("case,names", [
    ("fan_in_fan_out", ["fan_in_fan_out", "Conv1D"]),
    ("other base", ["(4, 64)", "(4, 32)", "another model"]),
    ("lm_head", ["lm_head"]),
    ("dora", ["use_dora"]),
])
def test_bad_adapters_are_refused_in_one_line(realistic_base, tmp_path, case, names):
    ckpt, hf_dir = realistic_base
    a = tmp_path / "adapter"
    if case == "fan_in_fan_out":
        _edit_config(_peft_adapter(a, hf_dir), fan_in_fan_out=False)
    elif case == "other base":
        _peft_adapter(a)
    elif case == "lm_head":
        _peft_adapter(a, hf_dir, target_modules=["c_attn", "lm_head"])
    else:
        _edit_config(_peft_adapter(a, hf_dir), use_dora=True)
    before = snapshot(tmp_path)
    assert_clean_failure(run_cli("merge", ckpt, a, "--out", tmp_path / "merged"), names)
    assert snapshot(tmp_path) == before
    if case != "other base":  # no base to judge shapes against: export reads the adapter alone
        assert_clean_failure(run_cli("export", a, "--to", "gguf", "--out", tmp_path / "gguf"), names)
        assert snapshot(tmp_path) == before


@pytest.mark.parametrize("split", [False, True])
def test_adapter_gguf_is_llama_cpp_lora_format(realistic_base, tmp_path, split):
    """Read back with the gguf package: the keys llama.cpp's adapter loader reads, tensor names and shapes as it
    checks them against the base's GGUF, and alpha / rank x lora_b lora_a = the adapter's own update."""
    import gguf

    from gpt2port.lora.peft import write_adapter

    ckpt, _ = realistic_base
    model = lora_model(ckpt, ("qkv", "fc"), rank=4, alpha=8.0, split_qkv=split)
    (tmp_path / "adapter").mkdir()
    write_adapter(tmp_path / "adapter", layer.deltas_of(model), str(ckpt))
    assert run_cli("export", tmp_path / "adapter", "--to", "gguf", "--out", tmp_path / "g").exit_code == 0
    assert run_cli("export", ckpt, "--to", "gguf", "--out", tmp_path / "base").exit_code == 0
    reader = gguf.GGUFReader(tmp_path / "g" / "adapter.gguf")

    def field(key):
        f = reader.fields[key]
        v = f.parts[f.data[0]]
        return bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else float(v[0])

    assert (field("general.type"), field("general.architecture"), field("adapter.type")) == ("adapter", "gpt2",
                                                                                           "lora")
    alpha = field("adapter.lora.alpha")
    assert alpha == 8.0
    base_dims = {t.name: list(t.shape) for t in gguf.GGUFReader(tmp_path / "base" / "model.gguf").tensors}
    tensors = {t.name: t for t in reader.tensors}
    deltas, _ = read_adapter(tmp_path / "adapter")
    assert len(tensors) == 2 * len(deltas) == 2 * 2 * 3
    for name, (a, b, scaling) in deltas.items():
        key = name.replace("blocks.", "blk.").replace(".attn.qkv", ".attn_qkv").replace(".mlp.fc", ".ffn_up")
        ta, tb = tensors[f"{key}.weight.lora_a"], tensors[f"{key}.weight.lora_b"]
        model_ne = base_dims[f"{key}.weight"]
        assert ta.shape[0] == model_ne[0] and tb.shape[1] == model_ne[1] and ta.shape[1] == tb.shape[0]
        ga = torch.from_numpy(ta.data.copy()).reshape(a.shape)
        gb = torch.from_numpy(tb.data.copy()).reshape(b.shape)
        rank = tb.shape[0]  # ne[0] of lora_b: what llama.cpp divides alpha by
        assert rel(alpha / rank * gb @ ga, scaling * b @ a) <= 1e-6
