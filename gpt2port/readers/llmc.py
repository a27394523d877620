"""An llm.c model file read as a GPT-2: its header's sizes checked and made a config, its unnamed tensors named and
shaped by layouts/llmc.py, its tokenizer rebuilt from the gpt2_tokenizer.bin beside it (the bytes are
formats/llmc.py's)."""

from __future__ import annotations

from pathlib import Path

from gpt2port.config import GPTConfig
from gpt2port.errors import GPT2PortError
from gpt2port.formats.llmc import (MODEL_MAGIC, MODEL_VERSIONS, TOKENIZER_FILE, check_size, place, read_header,
                                   read_tokenizer)
from gpt2port.formats.safetensors import PreadReader
from gpt2port.layouts.llmc import LLMC, VOCAB_MULTIPLE, padded_vocab
from gpt2port.tokenizer import NO_TOKENIZER, vocab_and_merges


class LlmcReader(PreadReader):
    """An llm.c model file: the config from its header, each tensor read with pread at its place."""

    layout = LLMC.name

    def __init__(self, path: Path):
        self.path = Path(path)
        self.files = [self.path]
        ints, size = read_header(self.path, MODEL_MAGIC, MODEL_VERSIONS)
        dtype = MODEL_VERSIONS[ints[1]]
        max_t, vocab, n_layer, n_head, n_embd, padded = ints[2:8]
        if min(max_t, vocab, n_layer, n_head, n_embd) < 1 or n_embd % n_head:
            raise GPT2PortError(f"{self.path}: header sizes do not make a GPT-2 (max_seq_len {max_t}, vocab_size "
                                f"{vocab}, {n_layer} layers, {n_head} heads, {n_embd} channels)")
        if padded != padded_vocab(vocab):
            raise GPT2PortError(f"{self.path}: padded_vocab_size {padded} is not vocab_size {vocab} rounded up to a "
                                f"multiple of {VOCAB_MULTIPLE} ({padded_vocab(vocab)})")
        self.model_config = {"model_type": "gpt2", "n_layer": n_layer, "n_head": n_head, "n_embd": n_embd,
                             "vocab_size": vocab, "n_positions": max_t}
        # The blocks' matrices alone (12 C^2 per layer) bound the length from below: a header claiming huge sizes
        # fails here, on the file's length, before a single tensor is even listed.
        if n_layer * 12 * n_embd * n_embd * dtype.itemsize > size:
            raise GPT2PortError(f"{self.path}: truncated: a {n_layer}-layer, {n_embd}-wide model needs more than the "
                                f"file's {size} bytes")
        shapes = [(w.key, w.shape) for w in LLMC.order(LLMC.plan_write(_config(self.model_config, self.path)))]
        self.tensors, offset = place(self.path, shapes, dtype)
        check_size(self.path, offset, size, f"the {n_layer}-layer model its header describes")
        self.metadata = {}
        self.warnings: list[str] = []

    def inputs(self) -> list[Path]:
        return [*super().inputs(), self.path.parent / TOKENIZER_FILE]

    def embedded_tokenizer(self) -> tuple | None:
        """GPT-2's tokens and merges from a gpt2_tokenizer.bin beside the model file (llm.c keeps only the token
        bytes; the merges follow from them); None, with a warning, where there is none or it is not GPT-2's."""
        path = self.path.parent / TOKENIZER_FILE
        if not path.is_file():
            self.warnings.append(f"{self.path}: no tokenizer beside it ({TOKENIZER_FILE}); {NO_TOKENIZER}")
            return None
        try:
            return vocab_and_merges(*read_tokenizer(path), str(path))
        except GPT2PortError as e:
            self.warnings.append(f"{e}; {NO_TOKENIZER}")
            return None


def _config(fields: dict, path: Path) -> GPTConfig:
    return GPTConfig.from_hf_config(fields, str(path))
