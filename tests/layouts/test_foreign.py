"""Checkpoints saved by other from-scratch GPT classes, converted with no class at hand: nanoGPT's training
checkpoint (ckpt.pt, torch.compile'd or not), minGPT's state dict, and the state dict of the "LLMs from scratch"
GPTModel. Each file is written here from transformers' own GPT-2 by hand-written renames and transposes (not by
gpt2port's tables), converted, and the result must compute what transformers computes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from gpt2port import GPT, convert
from gpt2port.errors import GPT2PortError
from gpt2port.layouts import recognise

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _hf_state(hf) -> dict[str, torch.Tensor]:
    """transformers' GPT-2 tensors under bare names (wte.weight, h.0.attn.c_attn.weight, ...), Conv1D (in, out)."""
    return {k.removeprefix("transformer."): v.detach().clone() for k, v in hf.state_dict().items()
            if not k.startswith("lm_head")}


def nanogpt_state(hf, compiled: bool = False) -> dict[str, torch.Tensor]:
    """What nanoGPT's GPT.state_dict() holds for GPT-2's weights: nn.Linear (out, in), a mask buffer per block, the
    tied head saved too."""
    sd = {}
    for k, v in _hf_state(hf).items():
        sd["transformer." + k] = v.t().contiguous() if k.endswith(CONV1D) else v
    n_layer, T = hf.config.n_layer, hf.config.n_positions
    for i in range(n_layer):
        sd[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(T, T)).view(1, 1, T, T)
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    return {("_orig_mod." + k if compiled else k): v for k, v in sd.items()}


def llms_from_scratch_state(hf) -> dict[str, torch.Tensor]:
    """What the book's GPTModel (qkv_bias=True) holds once GPT-2's weights are loaded into it."""
    src, C = _hf_state(hf), hf.config.n_embd
    sd = {"tok_emb.weight": src["wte.weight"], "pos_emb.weight": src["wpe.weight"],
          "final_norm.scale": src["ln_f.weight"], "final_norm.shift": src["ln_f.bias"],
          "out_head.weight": src["wte.weight"].clone()}
    T = hf.config.n_positions
    for i in range(hf.config.n_layer):
        h, b = f"h.{i}.", f"trf_blocks.{i}."
        w, bias = src[h + "attn.c_attn.weight"], src[h + "attn.c_attn.bias"]  # (C, 3C): columns q | k | v
        for j, name in enumerate(("W_query", "W_key", "W_value")):
            sd[b + f"att.{name}.weight"] = w[:, j * C:(j + 1) * C].t().contiguous()
            sd[b + f"att.{name}.bias"] = bias[j * C:(j + 1) * C].clone()
        sd[b + "att.out_proj.weight"] = src[h + "attn.c_proj.weight"].t().contiguous()
        sd[b + "att.out_proj.bias"] = src[h + "attn.c_proj.bias"]
        sd[b + "ff.layers.0.weight"] = src[h + "mlp.c_fc.weight"].t().contiguous()
        sd[b + "ff.layers.0.bias"] = src[h + "mlp.c_fc.bias"]
        sd[b + "ff.layers.2.weight"] = src[h + "mlp.c_proj.weight"].t().contiguous()
        sd[b + "ff.layers.2.bias"] = src[h + "mlp.c_proj.bias"]
        for n, ln in (("norm1", "ln_1"), ("norm2", "ln_2")):
            sd[b + f"{n}.scale"], sd[b + f"{n}.shift"] = src[h + f"{ln}.weight"], src[h + f"{ln}.bias"]
        sd[b + "att.mask"] = torch.triu(torch.ones(T, T), diagonal=1)
    return sd


def _src(tmp_path):
    (tmp_path / "src").mkdir()
    return tmp_path / "src"


def model_args(hf, **over) -> dict:
    c = hf.config
    return {"n_layer": c.n_layer, "n_head": c.n_head, "n_embd": c.n_embd, "block_size": c.n_positions,
            "bias": True, "vocab_size": c.vocab_size, "dropout": 0.0, **over}


def assert_computes_like(ckpt, hf) -> None:
    ids = torch.randint(0, hf.config.vocab_size, (2, hf.config.n_positions), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = GPT.from_pretrained(ckpt)(ids)[0]
        ref = hf.eval()(ids).logits
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "torch.compile"])
def test_nanogpt_training_checkpoint_converts(tiny_hf_model, tmp_path, compiled):
    src = _src(tmp_path)
    ckpt = {"model": nanogpt_state(tiny_hf_model, compiled), "model_args": model_args(tiny_hf_model),
            "optimizer": {"state": {}, "param_groups": [{"lr": 6e-4}]}, "iter_num": 5000,
            "best_val_loss": torch.tensor(2.85), "config": {"dataset": "openwebtext"}}
    torch.save(ckpt, src / "ckpt.pt")
    result = convert(src / "ckpt.pt", tmp_path / "out")
    assert result.n_params == GPT.from_pretrained(tmp_path / "out").num_params()
    assert_computes_like(tmp_path / "out", tiny_hf_model)


def test_mingpt_state_dict_with_its_n_head_from_a_config(tiny_hf_model, tmp_path):
    """minGPT saves model.state_dict() (nanoGPT's names); the sizes come from a config.json beside it."""
    src = _src(tmp_path)
    import json

    torch.save(nanogpt_state(tiny_hf_model), src / "model.pt")
    (src / "config.json").write_text(json.dumps(tiny_hf_model.config.to_dict()))
    convert(src / "model.pt", tmp_path / "out")
    assert_computes_like(tmp_path / "out", tiny_hf_model)


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_llms_from_scratch_state_dict_converts(tiny_hf_model, tmp_path, suffix):
    src = _src(tmp_path)
    import json

    sd = llms_from_scratch_state(tiny_hf_model)
    path = src / f"gpt2-small{suffix}"
    if suffix == ".pth":
        torch.save(sd, path)
    else:
        save_file({k: v.contiguous() for k, v in sd.items()}, path)
    (src / "config.json").write_text(json.dumps(tiny_hf_model.config.to_dict()))
    convert(path, tmp_path / "out")
    assert_computes_like(tmp_path / "out", tiny_hf_model)


def test_the_layout_is_told_by_names_and_shapes(tiny_hf_model):
    shapes = lambda sd: {k: tuple(v.shape) for k, v in sd.items()}  # noqa: E731
    hf_names = {k: tuple(v.shape) for k, v in tiny_hf_model.state_dict().items()}
    assert recognise(hf_names).name == "hf"
    # the same names, stored (out, in): only the q|k|v shape tells nanoGPT's file from HF's
    assert recognise(shapes(nanogpt_state(tiny_hf_model))).name == "nanogpt"
    assert recognise(shapes(llms_from_scratch_state(tiny_hf_model))).name == "llms-from-scratch"


def test_foreign_files_that_cannot_be_gpt2_are_refused(tiny_hf_model, tmp_path):
    src = _src(tmp_path)
    torch.save({"model": nanogpt_state(tiny_hf_model), "model_args": model_args(tiny_hf_model, bias=False)},
               src / "nobias.pt")
    with pytest.raises(GPT2PortError, match="nobias.pt: model_args say bias=False"):
        convert(src / "nobias.pt", tmp_path / "a")
    sd = llms_from_scratch_state(tiny_hf_model)
    sd["out_head.weight"] = sd["out_head.weight"] + 0.01  # fine-tuned apart from the embedding
    torch.save(sd, src / "untied.pth")
    import json

    (src / "config.json").write_text(json.dumps(tiny_hf_model.config.to_dict()))
    with pytest.raises(GPT2PortError, match="'out_head.weight' differs from tok_emb.weight"):
        convert(src / "untied.pth", tmp_path / "b")
    del sd["trf_blocks.1.att.W_key.bias"]  # one third of a fused tensor missing is named, not merged wrongly
    sd["out_head.weight"] = sd["tok_emb.weight"]
    torch.save(sd, src / "partial.pth")
    with pytest.raises(GPT2PortError, match=r"partial.pth: missing keys: trf_blocks.1.att.W_key.bias$"):
        convert(src / "partial.pth", tmp_path / "d")
    torch.save({"optimizer": {}, "step": 3}, src / "odd.pt")
    with pytest.raises(GPT2PortError, match="odd.pt: is neither a flat state dict"):
        convert(src / "odd.pt", tmp_path / "c")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
