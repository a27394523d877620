"""Canonical tensors (a gpt2port checkpoint, or tensors held in memory) as the float64 reference's input: the same
face as HFFiles (bare HF keys, Conv1D (in, out) storage, a config dict), so that Float64GPT2 computes GPT-2 over
them with its own code. The name table is written out here, apart from gpt2port's layout tables.

A gpt2port checkpoint is trusted as written: its conversion was checked against its source (gpt2port verify); a
model in memory is then judged against those exact weights (a fine-tuned model against its own checkpoint)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Mapping

import torch

from gpt2port.errors import GPT2PortError

# HF bare key -> (canonical name, stored transposed by Conv1D)
_TOP = {"wte.weight": ("tok_emb.weight", False), "wpe.weight": ("pos_emb.weight", False),
        "ln_f.weight": ("final_norm.weight", False), "ln_f.bias": ("final_norm.bias", False),
        "lm_head.weight": ("lm_head.weight", False)}
_BLOCK = {"ln_1.weight": ("ln1.weight", False), "ln_1.bias": ("ln1.bias", False),
          "attn.c_attn.weight": ("attn.qkv.weight", True), "attn.c_attn.bias": ("attn.qkv.bias", False),
          "attn.c_proj.weight": ("attn.proj.weight", True), "attn.c_proj.bias": ("attn.proj.bias", False),
          "ln_2.weight": ("ln2.weight", False), "ln_2.bias": ("ln2.bias", False),
          "mlp.c_fc.weight": ("mlp.fc.weight", True), "mlp.c_fc.bias": ("mlp.fc.bias", False),
          "mlp.c_proj.weight": ("mlp.proj.weight", True), "mlp.c_proj.bias": ("mlp.proj.bias", False)}
_LAYER = re.compile(r"^h\.(\d+)\.(.+)$")


def _canonical(key: str) -> tuple[str, bool] | None:
    if key in _TOP:
        return _TOP[key]
    m = _LAYER.match(key)
    if m and m.group(2) in _BLOCK:
        name, flip = _BLOCK[m.group(2)]
        return f"blocks.{m.group(1)}.{name}", flip
    return None


def hf_key(name: str) -> str | None:
    for key, (canon, _) in _TOP.items():
        if canon == name:
            return key
    m = re.match(r"^blocks\.(\d+)\.(.+)$", name)
    for key, (canon, _) in _BLOCK.items():
        if m and canon == m.group(2):
            return f"h.{m.group(1)}.{key}"
    return None


class CanonicalFiles:
    """tensors: canonical name -> tensor (or a function returning it, called when read); config: HF config.json's
    fields; label: what error messages name."""

    def __init__(self, tensors: Mapping[str, torch.Tensor | Callable[[], torch.Tensor]], config: dict,
                 label: str | Path, root: Path | None = None):
        self.tensors, self.hf_config, self.label = tensors, dict(config), str(label)
        self.root = Path(root) if root is not None else Path(self.label)
        self.files = [Path(self.label)]
        self._keys = {k: n for n in tensors if (k := hf_key(n)) is not None}

    def config_dict(self) -> dict:
        return dict(self.hf_config)

    def has(self, key: str) -> bool:
        return key in self._keys

    def keys(self) -> list[str]:
        return list(self._keys)

    def _tensor(self, key: str) -> torch.Tensor:
        found = _canonical(key)
        if key not in self._keys or found is None:
            raise GPT2PortError(f"{self.label}: reference tensor {key!r} not found")
        t = self.tensors[found[0]]
        t = t() if callable(t) else t
        return t.t() if found[1] else t

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensor(key).shape)

    def get(self, key: str) -> torch.Tensor:
        return self._tensor(key).clone()

    def get64(self, key: str) -> torch.Tensor:
        return self._tensor(key).to(torch.float64, copy=True)

    def close(self) -> None:
        pass


def checkpoint_files(path: Path) -> CanonicalFiles:
    """A gpt2port checkpoint directory's own weights, memory-mapped (nothing read until a block needs it)."""
    from gpt2port.checkpoint import load_state

    ckpt_dir, config, tensors = load_state(path)
    return CanonicalFiles(tensors, config.to_hf_config(), ckpt_dir / "model.safetensors", root=ckpt_dir)


def is_gpt2port_checkpoint(path: Path) -> bool:
    """A directory whose config.json says it is gpt2port's (an HF directory has model.safetensors and config.json
    too)."""
    from gpt2port import inputs
    from gpt2port.checkpoint import CONFIG, CONFIG_FORMAT, is_checkpoint

    if not (path.is_dir() and is_checkpoint(path)):
        return False
    try:
        return inputs.read_json(path / CONFIG).get("format") == CONFIG_FORMAT
    except (OSError, GPT2PortError):
        return False
