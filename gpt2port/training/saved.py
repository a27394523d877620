"""A run's saved training state read back through one validating loader, before anything of the run is touched:
meta.json (its fields and their types, the settings in range), every rank's rng-R.pt (tensors only, of a random
state's shape), the torch.distributed.checkpoint metadata (unpickled with only DCP's own classes allowed; every
entry of the shard set present with the bytes it claims; every tensor of the shape this model and its optimizer
have) and train_log.jsonl. Each refusal is one line naming the file; the run is left as it was.

torch.distributed.checkpoint itself reads `.metadata` with a plain pickle.load, and the optimizer's non-tensor
entries with torch.load(weights_only=False): the loader gives DCP the metadata it checked, and a planner that loads
those entries with weights_only=True (state.py).
"""

from __future__ import annotations

import io
import json
import math
import pickle
import re
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2port import inputs
from gpt2port.errors import GPT2PortError
from gpt2port.training import limits
from gpt2port.training.loop import read_rows

FORMAT = "gpt2port-train-state/1"
WORLD_MAX = 1 << 16
RNG_BYTES_MAX = 1 << 20  # a saved random state is ~7 KB
METADATA_BYTES_MAX = 1 << 28
SHARD = re.compile(r"__\d{1,6}_\d{1,6}\.distcp")
_DCP = "torch.distributed.checkpoint.metadata"
ALLOWED = {(_DCP, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                               "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict")}


@dataclass
class SavedRun:
    dir: Path
    step: int
    world: int
    settings: dict
    rng: dict[int, dict[str, torch.Tensor]]
    metadata: object  # torch.distributed.checkpoint.metadata.Metadata, checked


def read(state_dir: Path, *, log: Path, fields, config, model: torch.nn.Module | None = None,
         model_for=None) -> SavedRun:
    """The saved state in state_dir, every file of it checked (see the module docstring). fields: the names the
    settings must hold; model: what the state must fit, or model_for(settings) makes it from the saved settings
    (default: a GPT of `config`, built without memory)."""
    step, world, settings = _meta(state_dir / "meta.json", fields, config)
    if model is None and model_for is not None:
        model = model_for(settings)
    rng = {r: _rng(state_dir / f"rng-{r}.pt") for r in range(world)}
    metadata = _metadata(state_dir / ".metadata")
    _shards(state_dir, metadata)
    if model is None:
        from gpt2port.model import GPT

        with torch.device("meta"):
            model = GPT(config)
    _shapes(state_dir / ".metadata", metadata, expected_shapes(model))
    if log.exists():
        _regular(log)
    read_rows(log, step)
    return SavedRun(state_dir, step, world, settings, rng, metadata)


def _regular(path: Path, limit: int | None = None) -> int:
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise GPT2PortError(f"{path}: missing from the saved training state") from None
    if not stat.S_ISREG(st.st_mode):
        raise GPT2PortError(f"{path}: not a regular file")
    if limit is not None and st.st_size > limit:
        raise GPT2PortError(f"{path}: {st.st_size:,} bytes, more than a file of this kind holds ({limit:,})")
    return st.st_size


def _meta(path: Path, fields, config) -> tuple[int, int, dict]:
    _regular(path, 1 << 20)
    meta = inputs.read_json(path, limit=1 << 20)
    if meta.get("format") != FORMAT:
        raise GPT2PortError(f"{path}: not a gpt2port training state (format {str(meta.get('format'))[:80]!r})")
    settings = meta.get("settings")
    if not isinstance(settings, dict):
        raise GPT2PortError(f"{path}: \"settings\" must be an object of the run's settings")
    missing = [f for f in fields if f not in settings]
    if missing:
        raise GPT2PortError(f"{path}: settings lack {', '.join(missing)}")
    limits.check(settings, lambda name, value: f"{path}: settings.{name} = {_shown(value)}")
    if settings["block_size"] > config.n_positions:
        raise GPT2PortError(f"{path}: settings.block_size = {settings['block_size']}: beyond the model's context, "
                            f"{config.n_positions}")
    world, step = meta.get("world"), meta.get("step")
    if not _whole(world) or not 1 <= world <= WORLD_MAX:
        raise GPT2PortError(f"{path}: \"world\" must be a whole number from 1 to {WORLD_MAX}, not {_shown(world)}")
    if not _whole(step) or not 1 <= step < settings["steps"]:
        raise GPT2PortError(f"{path}: \"step\" must be a whole number from 1 to {settings['steps'] - 1} (the run's "
                            f"steps, less one), not {_shown(step)}")
    return step, world, settings


def _shown(v) -> str:
    return json.dumps(v)[:80]


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _rng(path: Path) -> dict[str, torch.Tensor]:
    """A rank's saved generators: tensors only (weights_only), a CPU state of the size this torch's has."""
    _regular(path, RNG_BYTES_MAX)
    raw = io.BytesIO(inputs.read_bytes(path, RNG_BYTES_MAX, "a saved random state"))
    try:
        with warnings.catch_warnings():  # torch warns of pickle protocols it may not read: it refuses them anyway
            warnings.simplefilter("ignore")
            rng = torch.load(raw, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - whatever the bytes make torch.load raise, the file is refused
        raise GPT2PortError(f"{path}: not a saved random state (torch.load: {type(e).__name__})") from None
    cpu = torch.get_rng_state()
    if not isinstance(rng, dict) or set(rng) - {"cpu", "cuda"} or not _state(rng.get("cpu"), cpu.numel()):
        raise GPT2PortError(f"{path}: not a saved random state (expected a CPU generator state of {cpu.numel()} "
                            f"bytes)")
    if "cuda" in rng and not _state(rng["cuda"], None):
        raise GPT2PortError(f"{path}: not a saved random state (its CUDA generator state is not a byte tensor)")
    return rng


def _state(t, n: int | None) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 and not t.is_sparse
            and (n is None or t.numel() == n) and t.numel() <= RNG_BYTES_MAX)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def _metadata(path: Path):
    from torch.distributed.checkpoint.metadata import Metadata

    _regular(path, METADATA_BYTES_MAX)
    raw = io.BytesIO(inputs.read_bytes(path, METADATA_BYTES_MAX, "DCP metadata"))
    try:
        metadata = _Unpickler(raw).load()
    except Exception as e:  # noqa: BLE001 - a hostile pickle fails in many ways; each is this one refusal
        raise GPT2PortError(f"{path}: not a torch.distributed.checkpoint metadata file "
                            f"({type(e).__name__}: {' '.join(str(e).split())[:160]})") from None
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict) \
            or not isinstance(getattr(metadata, "storage_data", None), dict):
        raise GPT2PortError(f"{path}: not a torch.distributed.checkpoint metadata file")
    return metadata


def _shards(state_dir: Path, metadata) -> None:
    """Every storage entry well formed, in a shard file of this directory that holds its bytes."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    where = state_dir / ".metadata"
    ends: dict[str, int] = {}
    for key, info in metadata.storage_data.items():
        if not isinstance(key, MetadataIndex) or not isinstance(info, _StorageInfo) \
                or not isinstance(info.relative_path, str) or not SHARD.fullmatch(info.relative_path) \
                or not _whole(info.offset) or not _whole(info.length) or info.offset < 0 or info.length < 0 \
                or getattr(info, "transform_descriptors", None):
            raise GPT2PortError(f"{where}: a malformed storage entry ({str(key)[:120]})")
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = _regular(state_dir / name)
        if size < end:
            raise GPT2PortError(f"{state_dir / name}: {size:,} bytes, but {where.name} places data up to byte "
                                f"{end:,} (truncated)")


def expected_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """What a state saved from `model` and its AdamW holds, named as torch.distributed.checkpoint names it."""
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    shapes = {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items() if k not in frozen}  # as saved
    for name, p in model.named_parameters():  # a tied parameter is named once: it has one optimizer state
        if p.requires_grad:
            shapes |= {f"optim.state.{name}.exp_avg": tuple(p.shape), f"optim.state.{name}.exp_avg_sq":
                       tuple(p.shape), f"optim.state.{name}.step": ()}
    return shapes


def _shapes(where: Path, metadata, expected: dict[str, tuple[int, ...]]) -> None:
    """Each tensor the model needs is in the state, of the model's shape, its chunks covering it with bytes."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    entries = metadata.state_dict_metadata
    for fqn, shape in expected.items():
        entry = entries.get(fqn)
        if not isinstance(entry, TensorStorageMetadata):
            raise GPT2PortError(f"{where}: holds no tensor {fqn} (a state saved from another model?)")
        size = tuple(entry.size) if isinstance(entry.size, torch.Size) else None
        if size != shape:
            raise GPT2PortError(f"{where}: {fqn} is {list(size or [])} in the saved state, {list(shape)} in this "
                                f"model (a run of a model of another shape)")
        dtype = getattr(entry.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise GPT2PortError(f"{where}: {fqn} is not stored as floating point")
        covered = 0
        for chunk in entry.chunks if isinstance(entry.chunks, list) else [None]:
            offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
            if not (isinstance(offsets, torch.Size) and isinstance(sizes, torch.Size)
                    and len(offsets) == len(sizes) == len(shape)
                    and all(0 <= o and o + s <= d for o, s, d in zip(offsets, sizes, shape))):
                raise GPT2PortError(f"{where}: {fqn} has a chunk outside its shape")
            info = metadata.storage_data.get(MetadataIndex(fqn, offsets))
            n = math.prod(sizes)
            if info is None or info.length < n * dtype.itemsize:
                raise GPT2PortError(f"{where}: {fqn} has a chunk with no stored bytes, or fewer than it needs")
            covered += n
        if covered != math.prod(shape):
            raise GPT2PortError(f"{where}: the chunks of {fqn} do not cover it")
