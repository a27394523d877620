"""Where conversion starts: a path -> a Source (a format reader, the layout its names are in, the model's config,
and the small files that travel with the weights).

A path may be a Hugging Face repo directory or weights file (single or sharded safetensors, pytorch_model.bin), or
a gpt2port checkpoint. Sources are only ever opened for reading.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpt2port import checkpoint
from gpt2port.config import GPTConfig
from gpt2port.errors import GPT2PortError
from gpt2port.formats import Reader
from gpt2port.formats.tf_bundle import STATE_FILE, index_for
from gpt2port.fsio import scratch_directory
from gpt2port.inputs import read_json, refuse_special
from gpt2port.hashing import Hashes
from gpt2port.layouts import GPT2PORT, Layout, canonical
from gpt2port.layouts import get as get_layout, recognise
from gpt2port.layouts.gpt2port import FORMAT_KEY, READABLE
from gpt2port.layouts.infer import check_config_matches_weights, infer_config
from gpt2port.layouts.openai_tf import OPENAI_TF
from gpt2port.readers import find_weights, open_weights
from gpt2port.tokenizer import (NO_TOKENIZER, TOKENIZER_FILES, VOCAB_MERGES, defines_tokenizer, side_file_problem,
                                write_bpe_files)


@dataclass
class Source:
    path: Path  # as given
    reader: Reader
    layout: Layout
    config: GPTConfig
    config_path: Path | None  # None: the config was inferred from the shapes
    _beside: list[Path] | None = field(default=None, repr=False)  # tokenizer files beside it, once checked
    _left_out: list[str] = field(default_factory=list, repr=False)  # why others were not
    _embedded: tuple | None = field(default=None, repr=False)  # (tokens, merges) once read, () where none
    _tokenizer_dir: Path | None = field(default=None, repr=False)  # where they were written out as files

    @property
    def root(self) -> Path:
        return self.path if self.path.is_dir() else self.path.parent

    @property
    def where(self) -> str:
        return ", ".join(str(f) for f in self.reader.files)

    def tokenizer_files(self) -> list[Path]:
        return self._tokenizer_beside() or self._rebuilt_tokenizer()

    def tokenizer_names(self) -> list[str]:
        """The names of tokenizer_files(), without having a format rebuild them yet."""
        return [f.name for f in self._tokenizer_beside()] or self._embedded_names()

    def _embedded_names(self) -> list[str]:
        """The names of the files _rebuilt_tokenizer() gives, without writing them: a conversion asks early, and has
        them written only inside the output it builds."""
        if self._embedded is None:
            self._embedded = self.reader.embedded_tokenizer() or ()
        return list(VOCAB_MERGES[0]) if self._embedded else []

    def _rebuilt_tokenizer(self) -> list[Path]:
        """vocab.json + merges.txt rebuilt from what the weights file carries, for when none lie beside it: in a
        scratch directory (inside the output being built: fsio.scratch_directory) that close() removes."""
        if self._tokenizer_dir is None or not self._tokenizer_dir.is_dir():  # (an earlier output's went with it)
            if not self._embedded_names():
                return []
            self._tokenizer_dir = scratch_directory(f"gpt2port-{self.reader.layout or 'source'}-tokenizer-")
            write_bpe_files(self._tokenizer_dir, *self._embedded)
        return sorted(self._tokenizer_dir.iterdir())

    def _tokenizer_beside(self) -> list[Path]:
        """The tokenizer files beside the weights that really are GPT-2's: a file under such a name (perhaps a link
        to anything at all) is carried into the output only if it has a tokenizer file's shape."""
        if self._beside is None:
            self._beside = []
            for f in (self.root / n for n in TOKENIZER_FILES):
                if not f.is_file():
                    continue
                problem = side_file_problem(f)
                if problem is None:
                    self._beside.append(f)
                else:
                    link = f" (a link to {os.path.realpath(f)})" if f.is_symlink() else ""
                    self._left_out.append(f"{f}{link}: not a GPT-2 tokenizer file ({problem}); left out of the output")
        return self._beside

    def read_files(self) -> list[Path]:
        """Every file this source is read from (weights, shards, index, config, side files, a TensorFlow `checkpoint`
        pointer), once per real path: what an output must never replace."""
        files = [self.path, *self.reader.inputs(), self.config_path, *(self.root / n for n in TOKENIZER_FILES)]
        if self.reader.layout == OPENAI_TF.name:
            files.append(self.root / STATE_FILE)
        return list({os.path.realpath(f): f for f in files if f is not None and os.path.lexists(f)}.values())

    def warnings(self) -> list[str]:
        """What opening the source found that the output should report."""
        found = self.tokenizer_names()  # a format that rebuilds its tokenizer warns if it cannot
        warnings = [*self._left_out, *self.reader.warnings]
        if not defines_tokenizer(found) and not any(NO_TOKENIZER in w for w in warnings):
            warnings.append(f"{self.root}: no GPT-2 tokenizer files beside the weights; {NO_TOKENIZER}")
        return warnings

    def side_files(self) -> list[Path]:
        """The small files that travel with the weights: index, config, tokenizer (not one rebuilt from the
        weights file)."""
        index = [self.reader.index_file] if self.reader.index_file else []
        return index + ([self.config_path] if self.config_path else []) + self._tokenizer_beside()

    def dtype(self) -> torch.dtype:
        """The weights' dtype: that of the token embedding (mask buffers are often fp32 in fp16 files)."""
        key = next((k for k in self.reader.tensors if self.layout.strip(k) == self.layout.key_for(canonical.EMBEDDING)),
                   next(iter(self.reader.tensors)))
        return self.reader.tensors[key].dtype

    def close(self) -> None:
        self.reader.close()
        if self._tokenizer_dir is not None:
            shutil.rmtree(self._tokenizer_dir, ignore_errors=True)
            self._tokenizer_dir = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def source_path(source) -> Path:
    """A path as it is; a model NAME as its converted checkpoint under ./checkpoints."""
    path = Path(source)
    return path if path.exists() else checkpoint.resolve(source)


def open_source(path: str | Path, hashes: Hashes | None = None) -> Source:
    """The source at `path`; its reader offers what it reads to `hashes` (the caller's session) when given."""
    path = Path(path)
    if path.is_dir():
        weights = find_weights(path)
    elif (index := index_for(path)) is not None:  # a TensorFlow checkpoint named by prefix, state file or shard
        weights = index
    elif path.exists() or path.is_symlink():
        weights = path
    else:
        raise GPT2PortError(f"{path}: no such file or directory")
    reader = open_weights(weights)
    reader.hashes = hashes
    try:
        tag = reader.metadata.get(FORMAT_KEY)
        if tag is not None and tag not in READABLE:
            raise GPT2PortError(f"{weights}: written in gpt2port layout {tag!r}; "
                                f"this version reads {', '.join(READABLE)}")
        layout = GPT2PORT if tag is not None else get_layout(reader.layout) if reader.layout else \
            recognise({k: t.shape for k, t in reader.tensors.items()})
        config, config_path = _config(reader, layout, weights.parent)
        return Source(path, reader, layout, config, config_path)
    except BaseException:
        reader.close()
        raise


def _config(reader: Reader, layout: Layout, root: Path) -> tuple[GPTConfig, Path | None]:
    shapes = layout.canonical_shapes({k: t.shape for k, t in reader.tensors.items()})
    if reader.model_config is not None:  # the file (or one that goes with it) says what model it holds
        where = reader.config_file or reader.path
        config = GPTConfig.from_hf_config(reader.model_config, str(where), reader.config_keys)
        check_config_matches_weights(config, shapes, where)
        return config, reader.config_file
    path = root / checkpoint.CONFIG
    refuse_special(path)
    if not path.is_file():
        return infer_config(shapes, reader.path), None
    if layout is GPT2PORT:
        config = checkpoint.read_config(root)
    else:
        config = GPTConfig.from_hf_config(read_json(path), str(path))
    check_config_matches_weights(config, shapes, path)
    return config, path
