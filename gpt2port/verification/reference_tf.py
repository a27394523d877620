"""OpenAI's TensorFlow checkpoints as the float64 reference's input: the same face as HFFiles (bare HF keys, HF's
Conv1D (in, out) storage, a config dict), with the bytes read by gpt2port's tensor-bundle reader (crc32c-checked)
and the names translated here, on their own: the reference does not share gpt2port's layout tables, so a mistake
in those tables cannot hide from it. The sizes are hparams.json's, in the one table of its names
(readers/openai_tf.py)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from gpt2port.errors import GPT2PortError
from gpt2port.formats import WEIGHT_FILES
from gpt2port.formats.tf_bundle import TFBundleReader, checkpoint_in, index_for
from gpt2port.readers.openai_tf import read_hparams

# model/h3/attn/c_attn/w -> h.3.attn.c_attn.weight; ln_1/g -> ln_1.weight; b -> bias
_LAYER = re.compile(r"^model/h(\d+)/(.+)$")
_LEAF = {"w": "weight", "g": "weight", "b": "bias"}


def is_tf(path: Path) -> bool:
    if path.is_dir():
        return not any((path / n).exists() for n in WEIGHT_FILES) and checkpoint_in(path) is not None
    return path.name.endswith(".index") or index_for(path) is not None


def hf_key(name: str) -> str:
    body = name.removeprefix("model/")
    m = _LAYER.match(name)
    if m:
        body = f"h.{m.group(1)}.{m.group(2)}"
    *scopes, leaf = body.split("/")
    return ".".join([*scopes, _LEAF.get(leaf, leaf)]) if scopes else f"{leaf}.weight"


class TFFiles:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = checkpoint_in(self.path) if self.path.is_dir() else (index_for(self.path) or self.path)
        if index is None:
            raise GPT2PortError(f"{self.path}: no TensorFlow checkpoint for the reference")
        self.reader = TFBundleReader(index)
        self.root = self.reader.index_file.parent
        self.files = self.reader.files
        self._names = {hf_key(n): n for n in self.reader.tensors}
        self._config = read_hparams(self.root)

    def config_dict(self) -> dict:
        """hparams.json in config.json's names (GPT-2's other settings are HF's defaults)."""
        return dict(self._config or {})

    def has(self, key: str) -> bool:
        return key in self._names

    def keys(self) -> list[str]:
        return list(self._names)

    def shape(self, key: str) -> tuple[int, ...]:
        shape = self.reader.tensors[self._name(key)].shape
        return shape[1:] if len(shape) == 3 else shape  # a 1x1 convolution kernel [1, in, out] is Conv1D's (in, out)

    def _name(self, key: str) -> str:
        if key not in self._names:
            raise GPT2PortError(f"{self.reader.index_file}: reference tensor {key!r} not found")
        return self._names[key]

    def get(self, key: str) -> torch.Tensor:
        t = self.reader.read(self._name(key))
        return (t[0] if t.dim() == 3 else t).clone()

    def get64(self, key: str) -> torch.Tensor:
        return self.get(key).to(torch.float64)

    def close(self) -> None:
        self.reader.close()


__all__ = ["TFFiles", "hf_key", "is_tf"]
