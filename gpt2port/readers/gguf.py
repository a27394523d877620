"""A GPT-2 GGUF read as a model: the architecture checked, the model's sizes and tokenizer from its metadata (the
bytes and key/values are formats/gguf.py's; the tensor names are layouts/gguf.py's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gpt2port.errors import GPT2PortError
from gpt2port.formats.gguf import KEYS, GGUFFile
from gpt2port.layouts.gguf import ARCH, GGUF
from gpt2port.tokenizer import NO_TOKENIZER


class GGUFReader(GGUFFile):
    """A GPT-2 GGUF (f32/f16/bf16 tensors): its tensors, the model's sizes and tokenizer from its metadata."""

    layout = GGUF.name
    config_keys = {k: v.format(arch=ARCH) for k, v in {  # config.json's names -> this file's
        "n_layer": KEYS.LLM.BLOCK_COUNT, "n_head": KEYS.Attention.HEAD_COUNT, "n_embd": KEYS.LLM.EMBEDDING_LENGTH,
        "n_positions": KEYS.LLM.CONTEXT_LENGTH, "n_inner": KEYS.LLM.FEED_FORWARD_LENGTH,
        "layer_norm_epsilon": KEYS.Attention.LAYERNORM_EPS}.items()}

    def __init__(self, path: Path):
        self._open(path)
        arch = self._string(KEYS.General.ARCHITECTURE)  # before the tensors: another model's are not ours to judge
        if arch != ARCH:
            raise GPT2PortError(f"{self.path}: a GGUF of architecture {str(arch)[:60]!r}, not GPT-2 ({ARCH!r})")
        self._list_tensors()
        self.model_config = self._model_config()

    def _model_config(self) -> dict:
        table = self.tensors.get(GGUF.key_for("tok_emb.weight"))
        if table is None:
            raise GPT2PortError(f"{self.path}: no {GGUF.key_for('tok_emb.weight')!r} tensor")
        embd = self._number(self.config_keys["n_embd"])
        ff = self._number(self.config_keys["n_inner"])
        eps = self._number(self.config_keys["layer_norm_epsilon"], real=True)
        return {
            "model_type": "gpt2",
            "n_layer": self._number(self.config_keys["n_layer"]),
            "n_head": self._number(self.config_keys["n_head"]),
            "n_embd": embd,
            "n_positions": self._number(self.config_keys["n_positions"]),
            "n_inner": None if ff == 4 * embd else ff,  # as config.json says it for every official GPT-2
            # Stored as float32: its shortest decimal gives back the 1e-5 that was written, not 9.99999974e-06.
            "layer_norm_epsilon": float(str(np.float32(eps))),
            "vocab_size": table.shape[0],
        }

    def embedded_tokenizer(self) -> tuple[list, list] | None:
        """The embedded tokenizer (see Reader.embedded_tokenizer); None, with a warning, where the file carries none."""
        model = self._string(KEYS.Tokenizer.MODEL, required=False)
        if model is None:  # the weights are usable; GPT-2's tokenizer can be put beside them (as for every format)
            self.warnings.append(f"{self.path}: no embedded tokenizer (no {KEYS.Tokenizer.MODEL!r} in its "
                                 f"metadata); {NO_TOKENIZER}")
            return None
        if model != "gpt2":  # token ids of another vocabulary: GPT-2's tokenizer would not fit these weights
            raise GPT2PortError(f"{self.path}: embedded tokenizer is {str(model)[:60]!r}, not GPT-2's byte-level BPE")
        # a token per row of the embedding, and each merge makes a token: bounds known before the lists are read
        tokens = self._strings(KEYS.Tokenizer.LIST, most=self.model_config["vocab_size"])
        merges = [tuple(m.split(" ")) for m in self._strings(KEYS.Tokenizer.MERGES, most=len(tokens))]
        if any(len(m) != 2 for m in merges):
            raise GPT2PortError(f"{self.path}: a tokenizer merge is not an 'a b' pair")
        return tokens, merges
