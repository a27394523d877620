"""OpenAI's TensorFlow release read as a GPT-2: a size directory as download_model.py leaves it (models/124M/:
checkpoint, model.ckpt.index and .data-*, hparams.json, encoder.json + vocab.bpe). The bundle's bytes are
formats/tf_bundle.py's, the variables' names layouts/openai_tf.py's, the tokenizer's file names tokenizer.py's; the
model's sizes are hparams.json's, read here."""

from __future__ import annotations

from pathlib import Path

from gpt2port import inputs
from gpt2port.formats.tf_bundle import TFBundleReader
from gpt2port.layouts.openai_tf import OPENAI_TF

HPARAMS_FILE = "hparams.json"
# OpenAI's hparams.json names -> config.json's
HPARAMS = {"n_layer": "n_layer", "n_head": "n_head", "n_embd": "n_embd", "n_vocab": "vocab_size",
           "n_ctx": "n_positions"}


def read_hparams(directory: Path) -> dict | None:
    """The hparams.json in `directory` in config.json's names (GPT-2's other settings are HF's defaults); None where
    there is none."""
    path = directory / HPARAMS_FILE
    if not path.is_file():
        return None
    raw = inputs.read_json(path)
    return {HPARAMS[k]: v for k, v in raw.items() if k in HPARAMS}


class OpenAITFReader(TFBundleReader):
    """A TensorFlow checkpoint of OpenAI's layout, its sizes from the hparams.json beside its .index."""

    layout = OPENAI_TF.name
    config_keys = {v: k for k, v in HPARAMS.items()}  # config.json's names -> hparams.json's, for refusals

    def __init__(self, path: str | Path):
        super().__init__(path)
        self.model_config = read_hparams(self.index_file.parent)
        if self.model_config is not None:
            self.config_file = self.index_file.parent / HPARAMS_FILE
