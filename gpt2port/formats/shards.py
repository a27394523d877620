"""Sharded weights: an index (model.safetensors.index.json, pytorch_model.bin.index.json) naming which file beside it
holds each tensor. The one place that reads such an index, for conversion, download and verification alike."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from gpt2port import inputs
from gpt2port.errors import GPT2PortError
from gpt2port.formats.base import Reader

INDEX_SUFFIX = ".index.json"


def read_index(index_path: Path) -> dict[str, str]:
    """tensor name -> shard file name, every name checked to be a plain file name beside the index: a name with a
    path in it could make us read (and hash into a manifest) any file on the disk."""
    index = inputs.read_json(index_path, None)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise GPT2PortError(f"{index_path}: no weight_map")
    for key, shard in weight_map.items():
        if not isinstance(shard, str) or shard in ("", ".", "..") or "/" in shard or "\\" in shard \
                or shard.startswith("."):
            raise GPT2PortError(f"{index_path}: key {key[:80]!r} is placed in {str(shard)[:80]!r}, which is not a "
                                f"file name beside the index")
        if shard.endswith(INDEX_SUFFIX):  # an index is not a shard: two naming each other would recurse for ever
            raise GPT2PortError(f"{index_path}: key {key[:80]!r} is placed in {shard[:80]!r}, another index, not a "
                                f"weights file")
    return weight_map


def shard_names(index_path: Path) -> list[str]:
    """The shard files an index names, sorted (the order their numbers give)."""
    return sorted(set(read_index(index_path).values()))


class ShardedReader(Reader):
    """Every shard an index names, opened with `open_file` and presented as one source."""

    _hashes = None

    def __init__(self, index_path: Path, open_file: Callable[[Path], Reader]):
        self.path = self.index_file = Path(index_path)
        weight_map = read_index(self.path)
        self.files = [self.path.parent / s for s in sorted(set(weight_map.values()))]
        self.metadata = {}
        self.tensors = {}
        self._readers: dict[str, Reader] = {}
        try:
            for f in self.files:
                if not f.is_file():
                    raise GPT2PortError(f"{f}: shard listed in {self.path.name} is missing")
                reader = open_file(f)
                self._readers[f.name] = reader
                for name, info in reader.tensors.items():
                    if weight_map.get(name) != f.name:
                        raise GPT2PortError(f"{f}: holds {name!r}, which {self.path.name} places in "
                                            f"{weight_map.get(name)!r}")
                    self.tensors[name] = info
        except BaseException:
            self.close()
            raise
        absent = [k for k in weight_map if k not in self.tensors]
        if absent:
            raise GPT2PortError(f"{self.path}: keys listed but absent from their shards: {', '.join(absent[:8])}")

    @property
    def hashes(self):
        return self._hashes

    @hashes.setter
    def hashes(self, hashes) -> None:  # each shard's reader offers what it reads to the same session
        self._hashes = hashes
        for r in self._readers.values():
            r.hashes = hashes

    def read(self, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        return self._readers[self.tensors[name].file.name].read(name, into)

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
