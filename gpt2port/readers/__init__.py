"""Opening a weights file: the format chosen by its name (formats/), and for the formats that carry a model's meaning
in the file itself or beside it (llm.c's, GGUF's, OpenAI's TensorFlow release) the reader that gives it as a GPT-2:
its config and tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpt2port.errors import GPT2PortError
from gpt2port.formats import WEIGHT_FILES, Reader
from gpt2port.formats.llmc import open_bin
from gpt2port.formats.safetensors import SafetensorsReader
from gpt2port.formats.shards import INDEX_SUFFIX, ShardedReader
from gpt2port.inputs import checked
from gpt2port.readers.llmc import LlmcReader
from gpt2port.readers.torch_pickle import ModelPickleReader


def _tf_reader(path: Path) -> Reader:
    from gpt2port.readers.openai_tf import OpenAITFReader

    return OpenAITFReader(path)


def _gguf_reader(path: Path) -> Reader:
    from gpt2port.readers.gguf import GGUFReader  # llama.cpp's package, imported only when a .gguf is read

    return GGUFReader(path)


# How a weights file is read, by the end of its name. The index row opens each shard through this same table.
READERS = {
    ".safetensors": SafetensorsReader,
    ".bin": lambda path: open_bin(path, ModelPickleReader, LlmcReader),  # a pickle, or llm.c's file (by its magic)
    ".pt": ModelPickleReader,
    ".pth": ModelPickleReader,
    INDEX_SUFFIX: lambda path: ShardedReader(path, open_weights),
    ".gguf": _gguf_reader,
    ".index": _tf_reader,  # a TensorFlow checkpoint: PREFIX.index beside PREFIX.data-*-of-*
}


def open_weights(path: str | Path) -> Reader:
    """A reader for one weights file (or a shard index), chosen by its name."""
    path = Path(path)
    # An HF cache snapshot is symlinks into blobs/: a deleted blob leaves a dangling link, worth naming as such.
    if path.is_symlink() and not path.exists():
        raise GPT2PortError(f"{path}: is a broken symbolic link (its target {os.readlink(path)} is missing)")
    if not path.exists():
        raise GPT2PortError(f"{path}: no such file or directory")
    checked(path, "a weights file")
    if path.stat().st_size == 0:
        raise GPT2PortError(f"{path}: file is empty")
    opener = next((make for suffix, make in READERS.items() if path.name.endswith(suffix)), None)
    if opener is None:
        raise GPT2PortError(f"{path}: unrecognised weights file (expected {', '.join(READERS)})")
    reader = opener(path)
    if not reader.tensors:
        reader.close()
        raise GPT2PortError(f"{path}: holds no tensors")
    return reader


def find_weights(directory: Path) -> Path:
    """The weights file of a repo directory, by WEIGHT_FILES' preference."""
    found = next((directory / n for n in WEIGHT_FILES if os.path.lexists(directory / n)), None)
    if found is None:
        from gpt2port.formats.tf_bundle import checkpoint_in  # OpenAI's release: models/124M/ and its kin

        found = checkpoint_in(directory)
    if found is None:
        raise GPT2PortError(f"{directory}: no GPT-2 weights found (looked for {', '.join(WEIGHT_FILES)}, or a "
                            f"TensorFlow checkpoint)")
    return found
