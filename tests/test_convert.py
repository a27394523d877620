"""Conversion core: every HF layout -> gpt2port -> logits equal transformers'; round trip; refusals; fast load.

Tolerance: the converted fp32 model and HF's run the same fp32 arithmetic in a different kernel order, so logits
agree to ~1e-6 absolute (measured max 1.5e-7 on the tiny model, ~2e-5 at 124M over 1024 positions with logits of
magnitude ~5). We assert atol=rtol=1e-5 (tiny) and atol=1e-4, rtol=1e-5 (full size, 1024 positions).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from scripts import hf_fixtures
from gpt2port import GPT
from gpt2port.cli import main
from gpt2port.config import GPTConfig
from gpt2port import convert
from gpt2port.errors import GPT2PortError
from gpt2port import export

FP32_TOL = dict(atol=1e-5, rtol=1e-5)


def hf_logits(hf_dir, idx):
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(idx).logits


def full_context_ids(config: GPTConfig, batch: int = 2, seed: int = 0) -> torch.Tensor:
    """Inputs at the full context length, so every position-embedding row is used."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, config.n_positions), generator=g)


@pytest.mark.parametrize("layout,dtype", [
    ("hub", "fp32"), ("save_pretrained", "fp32"), ("sharded", "fp32"), ("bin", "fp32"), ("with_head", "fp32"),
    ("hub", "fp16"), ("save_pretrained", "bf16"), ("sharded", "fp16"), ("bin", "bf16"),
])
def test_every_layout_converts_to_matching_logits(make_hf_repo, tmp_path, layout, dtype):
    src = make_hf_repo(layout, dtype)
    out = tmp_path / "ckpt"
    result = convert(src, out)
    assert result.dtype == hf_fixtures.DTYPES[dtype]  # default: keep the source's dtype
    model = GPT.from_pretrained(out, dtype=torch.float32)
    idx = full_context_ids(model.config)
    with torch.no_grad():
        ours, _ = model(idx)
    # HF reads the same (possibly fp16/bf16) weights; upcast to fp32 on both sides, so only the mapping can differ.
    torch.testing.assert_close(ours, hf_logits(src, idx), **FP32_TOL)


def test_weights_file_as_source_and_official_safetensors_reads_the_output(make_hf_repo, tmp_path):
    src = make_hf_repo("save_pretrained") / "model.safetensors"
    out = tmp_path / "ckpt"
    convert(src, out)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert f.metadata()["gpt2port_format"] == "gpt2port/v1"
        keys = set(f.keys())
        assert "lm_head.weight" not in keys and "tok_emb.weight" in keys  # tied head stored once
        assert f.get_tensor("blocks.0.attn.qkv.weight").shape == (96, 32)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["files"][0]["name"] == "model.safetensors"
    assert len(manifest["source"]["files"][0]["sha256"]) == 64
    assert {"vocab.json", "merges.txt", "config.json", "manifest.json"} <= {p.name for p in out.iterdir()}


def test_dtype_conversion_on_write(make_hf_repo, tmp_path):
    src = make_hf_repo("hub")
    for dtype, tdtype in [("bf16", torch.bfloat16), ("fp16", torch.float16)]:
        out = tmp_path / dtype
        convert(src, out, dtype=dtype)
        model = GPT.from_pretrained(out)
        assert model.tok_emb.weight.dtype == tdtype
        with safe_open(src / "model.safetensors", framework="pt") as f:
            w = f.get_tensor("h.1.attn.c_proj.weight")
        assert torch.equal(model.blocks[1].attn.proj.weight, w.t().to(tdtype))


def test_non_standard_config(tmp_path):
    """distilgpt2-like depth, a 50258 vocab (added pad token), explicit n_inner, other eps, exact GELU, no scaling."""
    cfg = hf_fixtures.hf_config(dict(n_layer=3, n_head=2, n_embd=16, n_positions=40, vocab_size=50258, n_inner=24,
                                     layer_norm_epsilon=1e-6, activation_function="gelu", scale_attn_weights=False))
    model = hf_fixtures.make_hf_model(cfg, seed=3)
    src = hf_fixtures.write_repo(model, tmp_path / "src", "save_pretrained")
    convert(src, tmp_path / "out")
    ours = GPT.from_pretrained(tmp_path / "out")
    assert (ours.config.n_layer, ours.config.vocab_size, ours.config.mlp_width) == (3, 50258, 24)
    idx = full_context_ids(ours.config)
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf_logits(src, idx), **FP32_TOL)


@pytest.mark.parametrize("setting,message", [
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True is not supported"),
    ({"add_cross_attention": True}, "add_cross_attention=True is not supported"),
    ({"activation_function": "quick_gelu"}, "activation_function 'quick_gelu' is not supported"),
    ({"model_type": "gpt_neo"}, "model_type 'gpt_neo' is not GPT-2"),
])
def test_unsupported_configs_are_refused(make_hf_repo, tmp_path, setting, message):
    src = tmp_path / "src"
    for p in make_hf_repo("save_pretrained").iterdir():
        (src / p.name).parent.mkdir(exist_ok=True)
        (src / p.name).write_bytes(p.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **setting}))
    with pytest.raises(GPT2PortError, match=message):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_head_that_differs_under_a_tied_config_is_refused(tiny_hf_model, tmp_path):
    """config.json says tied (GPT-2's default) but the file's lm_head.weight differs: converting would change the
    model. (A config that says untied keeps its head: tests/layouts/test_untied.py.)"""
    model = copy.deepcopy(tiny_hf_model)
    src = hf_fixtures.write_repo(model, tmp_path / "src", "with_head")
    from safetensors.torch import load_file, save_file

    sd = load_file(src / "model.safetensors")
    sd["lm_head.weight"] = sd["lm_head.weight"] + 0.01
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(GPT2PortError, match=r"model.safetensors: 'lm_head.weight' differs from wte.weight"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_round_trip_to_hf_is_bit_exact(make_hf_repo, tmp_path):
    src = make_hf_repo("save_pretrained")
    convert(src, tmp_path / "ours")
    export(tmp_path / "ours", tmp_path / "back", to="hf")
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    model, info = GPT2LMHeadModel.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_export_gpt2port_in_another_dtype(tiny_ckpt, tmp_path):
    result = export(tiny_ckpt, tmp_path / "bf16", to="gpt2port", dtype="bf16")
    assert result.dtype == torch.bfloat16
    a = GPT.from_pretrained(tiny_ckpt)
    b = GPT.from_pretrained(tmp_path / "bf16")
    assert b.blocks[0].mlp.fc.weight.dtype == torch.bfloat16
    assert torch.equal(b.blocks[0].mlp.fc.weight, a.blocks[0].mlp.fc.weight.to(torch.bfloat16))
    assert json.loads((tmp_path / "bf16" / "manifest.json").read_text())["exports"][0]["dtype"] == "bf16"


def test_load_is_tied_mapped_and_named(tiny_ckpt, tmp_path, monkeypatch):
    model = GPT.from_pretrained(tiny_ckpt)
    assert model.lm_head.weight is model.tok_emb.weight
    assert sum(1 for _ in model.parameters()) == len(model.state_dict()) - 1
    assert not model.training
    # A NAME resolves to ./checkpoints/NAME (root overridable for tests).
    (tmp_path / "gpt2").symlink_to(tiny_ckpt)
    monkeypatch.setenv("GPT2PORT_CHECKPOINTS", str(tmp_path))
    assert GPT.from_pretrained("124M").config == model.config
    half = GPT.from_pretrained(tiny_ckpt, dtype="bf16")
    assert half.tok_emb.weight.dtype == torch.bfloat16 and half.lm_head.weight is half.tok_emb.weight


def test_load_and_forward_stay_light(tiny_ckpt, tmp_path):
    """Loading and running a checkpoint imports neither transformers nor torch's compiler stack (which PyTorch pulls
    in for a normal_() on the meta device: ~1 s, and a torchinductor directory left in the temp dir)."""
    code = (f"import sys, torch; from gpt2port import GPT; m = GPT.from_pretrained({str(tiny_ckpt)!r}); "
            f"m(torch.tensor([[1, 2, 3]])); "
            f"assert not {{'transformers', 'torch._dynamo', 'torch._inductor'}} & set(sys.modules), sys.modules.keys()")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
    fresh = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, n_positions=16, vocab_size=40))  # training from scratch
    assert fresh.tok_emb.weight.std() > 0.01 and fresh.pos_emb.weight.std() > 0.01


def test_targets_give_the_same_loss_as_hf(make_hf_repo, tiny_ckpt):
    from transformers import GPT2LMHeadModel

    model = GPT.from_pretrained(tiny_ckpt)
    hf = GPT2LMHeadModel.from_pretrained(make_hf_repo("hub")).eval()
    idx = full_context_ids(model.config, batch=1)
    with torch.no_grad():
        _, loss = model(idx[:, :-1], targets=idx[:, 1:])
        torch.testing.assert_close(loss, hf(idx, labels=idx).loss, atol=1e-5, rtol=1e-5)


def test_cli_convert_and_info(make_hf_repo, tmp_path):
    runner = CliRunner()
    out = tmp_path / "ckpt"
    r = runner.invoke(main, ["convert", str(make_hf_repo("sharded")), "--out", str(out), "--dtype", "fp16"])
    assert r.exit_code == 0, r.output
    assert "1,635,744 parameters, fp16" in r.output
    r = runner.invoke(main, ["info", str(out)])
    assert r.exit_code == 0 and "total" in r.output and "1,635,744" in r.output and "fp16" in r.output
    r = runner.invoke(main, ["info", str(out), "--json"])
    facts = json.loads(r.output)
    assert facts["total_params"] == 1_635_744 and facts["manifest"]["source"]["files"]
    r = runner.invoke(main, ["convert", str(make_hf_repo("sharded")), "--out", str(out)])
    assert r.exit_code == 1 and "already exists (use --force" in r.output


@pytest.mark.fullsize
@pytest.mark.parametrize("size", ["gpt2", pytest.param("gpt2-medium", marks=pytest.mark.heavy)])  # 355M: -m heavy
def test_full_size_parity(size, tmp_path_factory, request):
    """Random weights at the real shapes, 1024 positions, against transformers."""
    if size == "gpt2":
        src = request.getfixturevalue("gpt2_hf_repo")
    else:
        src = tmp_path_factory.mktemp("hf-355m")
        hf_fixtures.write_repo(hf_fixtures.make_hf_model(hf_fixtures.hf_config(size), seed=355), src, "save_pretrained")
    out = tmp_path_factory.mktemp("out") / size
    result = convert(src, out)
    assert result.n_params == {"gpt2": 124_439_808, "gpt2-medium": 354_823_168}[size]
    model = GPT.from_pretrained(out)
    idx = full_context_ids(model.config, batch=1)
    with torch.no_grad():
        ours, _ = model(idx)
    expected = hf_logits(src, idx)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-5)
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() > 0.999


def test_weights_without_tokenizer_files_convert_with_a_warning_recorded_and_shown(make_hf_repo, tmp_path):
    """Python use works on such a checkpoint; `generate` cannot. The conversion says so at once (stderr), the
    manifest keeps it, and `info` shows it; a source with its tokenizer gets neither."""
    src = make_hf_repo("hub", tokenizer=False)
    out = tmp_path / "ckpt"
    result = CliRunner().invoke(main, ["convert", str(src), "--out", str(out), "-q"])
    assert result.exit_code == 0, result.output
    warning = next(line for line in result.stderr.splitlines() if line.startswith("warning:"))
    assert str(src) in warning and "no GPT-2 tokenizer files" in warning and "generate" in warning
    manifest = json.loads((out / "manifest.json").read_text())
    assert any("no GPT-2 tokenizer files" in w for w in manifest["warnings"])
    shown = CliRunner().invoke(main, ["info", str(out)])
    assert shown.exit_code == 0, shown.output
    assert "tokenizer   none" in shown.output and "warning     " in shown.output
    assert GPT.from_pretrained(out).config.n_layer == hf_fixtures.TINY["n_layer"]
    generated = CliRunner().invoke(main, ["generate", str(out), "The dog", "-n", "2"])
    assert generated.exit_code == 1 and "no GPT-2 tokenizer files" in generated.stderr

    with_tok = convert(make_hf_repo("hub"), tmp_path / "with")
    assert with_tok.warnings == []
    shown = CliRunner().invoke(main, ["info", str(tmp_path / "with")])
    assert "tokenizer   vocab.json, merges.txt" in shown.output and "warning" not in shown.output
