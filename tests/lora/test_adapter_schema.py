"""adapter_config.json's schema and an adapter's tensors, tried as a hostile or careless user would: every refusal
one line naming the key or tensor and the file, before anything is built; patterns resolved as peft resolves them,
never by running the file's regular expression."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from safetensors.torch import save_file

from gpt2port.errors import GPT2PortError
from gpt2port.lora import schema
from gpt2port.lora.peft import CONFIG, WEIGHTS, read_adapter, write_adapter
from tests.support import assert_clean_failure, run_cli, snapshot

C = 32  # the width of the adapters made here (a tiny GPT-2's)


def _adapter(where, layers=(0, 1), rank=2, alpha=4.0, value=0.01):
    g = torch.Generator().manual_seed(0)
    deltas = {f"blocks.{i}.attn.qkv": (torch.randn(rank, C, generator=g) * value,
                                       torch.randn(3 * C, rank, generator=g) * value, alpha / rank) for i in layers}
    where.mkdir()
    write_adapter(where, deltas, "base")
    return where


def _edit(adapter, **changes):
    path = adapter / CONFIG
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))
    return adapter


def _tensors(adapter, change):
    from safetensors.torch import load_file

    sd = load_file(adapter / WEIGHTS)
    change(sd)
    save_file(sd, adapter / WEIGHTS)
    return adapter


def _refused(adapter, *words):
    with pytest.raises(GPT2PortError) as e:
        read_adapter(adapter)
    line = str(e.value)
    assert "\n" not in line and all(w in line for w in words), line
    return line


@pytest.mark.parametrize("changes, words", [
    ({"r": 0}, ["r is 0", "rank"]),
    ({"r": 2.5}, ["r is 2.5"]),
    ({"r": True}, ["r is True"]),
    ({"lora_alpha": "8"}, ["lora_alpha is '8'"]),
    ({"lora_alpha": 1e309}, ["lora_alpha is inf", "finite"]),
    ({"lora_alpha": 0}, ["lora_alpha is 0"]),
    ({"use_rslora": "no"}, ["use_rslora is 'no'", "JSON boolean"]),
    ({"fan_in_fan_out": 1}, ["fan_in_fan_out is 1", "JSON boolean"]),
    ({"inference_mode": "yes"}, ["inference_mode"]),
    ({"lora_bias": True}, ["lora_bias"]),
    ({"layer_replication": [[0, 1]]}, ["layer_replication"]),
    ({"rank_pattern": {"c_attn": 0}}, ["rank_pattern['c_attn'] is 0"]),
    ({"rank_pattern": []}, ["rank_pattern is []"]),
    ({"alpha_pattern": {"c_attn": "x"}}, ["alpha_pattern['c_attn']"]),
    ({"alpha_pattern": {"(a|aa)+$": 3.0}}, ["alpha_pattern key", "regular expression"]),
    ({"rank_pattern": {"h\\.0\\..*": 2}}, ["rank_pattern key", "regular expression"]),
    ({"target_modules": ".*c_attn"}, ["target_modules", "regular expression"]),
    ({"target_modules": [3]}, ["target_modules is [3]"]),
    ({"exclude_modules": ".*"}, ["exclude_modules"]),
    ({"layers_to_transform": "0"}, ["layers_to_transform is '0'"]),
    ({"layers_to_transform": [-1]}, ["layers_to_transform"]),
    ({"layers_pattern": "layers"}, ["layers_pattern is 'layers'", "transformer.h.N"]),
    ({"peft_type": "IA3"}, ["peft_type is 'IA3'"]),
])
def test_a_config_of_the_wrong_types_is_refused_naming_the_key(tmp_path, changes, words):
    a = _edit(_adapter(tmp_path / "a"), **changes)
    _refused(a, str(a / CONFIG), *words)


def test_a_pattern_that_would_backtrack_is_refused_at_once(tmp_path):
    """The key that hung merge (~10 s for 16 characters, x3.5 per character) is refused in milliseconds."""
    a = _edit(_adapter(tmp_path / "a"), alpha_pattern={"(.*a){20}": 3.0})
    t0 = time.perf_counter()
    _refused(a, "alpha_pattern key", "(.*a){20}")
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("key", ["c_attn", "attn.c_attn", "h.1.attn.c_attn", "transformer.h.1.attn.c_attn",
                                 "1.attn.c_attn", "c_proj", "attn", "h.11.attn.c_attn", "11.attn.c_attn",
                                 "h.1.attn.c.attn", "ttn.c_attn", "transformer.h.1.attn.c_attn.x"])
def test_patterns_resolve_as_peft_resolves_them(key):
    """The linear-time rule gives peft's own get_pattern_key answer on GPT-2's module names."""
    module = "transformer.h.1.attn.c_attn"
    peft_answer = re.match(rf"(.*\.)?({key})$", module) is not None  # peft.utils.other.get_pattern_key's test
    assert schema._suffix(key, module) == peft_answer


def test_rank_and_alpha_patterns_each_take_their_first_match(tmp_path):
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "fan_in_fan_out": True,
           "rank_pattern": {"h.1.attn.c_attn": 6, "c_attn": 5}, "alpha_pattern": {"c_attn": 9, "h.1.attn.c_attn": 1}}
    s = schema.check(cfg, "adapter_config.json")
    assert s.rank("transformer.h.1.attn.c_attn") == 6 and s.rank("transformer.h.0.attn.c_attn") == 5
    assert s.rank("transformer.h.0.mlp.c_fc") == 2
    assert s.scaling("transformer.h.1.attn.c_attn", 6) == 9 / 6
    s = schema.check({**cfg, "use_rslora": True}, "adapter_config.json")
    assert s.scaling("transformer.h.0.mlp.c_fc", 4) == 4 / 2


def test_rank_from_the_tensors_and_the_config_must_agree(tmp_path):
    a = _edit(_adapter(tmp_path / "a"), r=3)
    _refused(a, str(a / WEIGHTS), "rank 2", "rank 3")


def test_layers_to_transform_is_honoured(tmp_path):
    a = _edit(_adapter(tmp_path / "a"), layers_to_transform=[0])
    _refused(a, "h.1.attn.c_attn", "layers_to_transform [0]", "layer 1")
    a = _edit(_adapter(tmp_path / "b"), layers_to_transform=[0, 1], layers_pattern="h")
    assert set(read_adapter(a)[0]) == {"blocks.0.attn.qkv", "blocks.1.attn.qkv"}
    a = _edit(_adapter(tmp_path / "c"), target_modules=["c_proj"])
    _refused(a, "target_modules ['c_proj'] do not name it")


@pytest.mark.parametrize("value, words", [(float("nan"), ["NaN or Inf"]), (float("inf"), ["NaN or Inf"]),
                                          (1e20, ["overflow float32"])])
def test_tensors_that_are_not_finite_or_overflow_are_named(tmp_path, value, words):
    """1e20 in A and in B is finite in float32, their product (1e40) is not."""
    pre = "base_model.model.transformer.h.1.attn.c_attn"

    def plant(sd):
        sd[f"{pre}.lora_B.weight"][0, 0] = value
        if value == 1e20:
            sd[f"{pre}.lora_A.weight"][0, 0] = value
    a = _tensors(_adapter(tmp_path / "a"), plant)
    line = _refused(a, str(a / WEIGHTS), *words)
    assert "h.1.attn.c_attn" in line


def test_rank_zero_and_shapes_no_gpt2_has(tmp_path):
    pre = "base_model.model.transformer.h.0.attn.c_attn"

    def rank0(sd):
        sd[f"{pre}.lora_A.weight"] = torch.zeros(0, C)
        sd[f"{pre}.lora_B.weight"] = torch.zeros(3 * C, 0)
    _refused(_tensors(_adapter(tmp_path / "a"), rank0), "rank 0")

    def square(sd):
        sd[f"{pre}.lora_B.weight"] = torch.zeros(C, 2)  # c_attn's outputs are 3C
    _refused(_tensors(_adapter(tmp_path / "b"), square), "32 x 32", "GPT-2's attn.c_attn")

    def two_widths(sd):
        sd[f"{pre}.lora_A.weight"] = torch.zeros(2, 16)
        sd[f"{pre}.lora_B.weight"] = torch.zeros(48, 2)
    _refused(_tensors(_adapter(tmp_path / "c"), two_widths), "width 16", "width 32")


def test_merge_and_export_refuse_in_one_line_and_leave_everything(tmp_path):
    """The commands: one line, exit 1, nothing written (no base is needed to refuse: the adapter is read first)."""
    a = _edit(_adapter(tmp_path / "a"), alpha_pattern={"(a|aa)+$": 3.0})
    before = snapshot(tmp_path)
    assert_clean_failure(run_cli("export", a, "--to", "gguf", "--out", tmp_path / "gguf"), ["alpha_pattern key"])
    assert snapshot(tmp_path) == before


def test_lora_alpha_inf_names_the_option(tmp_path):
    from gpt2port.config import GPTConfig
    from gpt2port.lora.spec import spec

    config = GPTConfig(n_layer=2, n_head=2, n_embd=C, vocab_size=256, n_positions=64)
    for alpha in (float("inf"), float("nan"), 0.0):
        with pytest.raises(GPT2PortError, match="--lora-alpha"):
            spec(4, alpha, "qkv", False, 0.0, config)
