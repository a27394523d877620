"""PyTorch's pickled state dicts (pytorch_model.bin, .pt, .pth), loaded only with torch.load(weights_only=True).

Unpickling can run arbitrary code, so a pickle is loaded only by the restricted unpickler that accepts tensors and
plain containers and refuses everything else. There is no fallback to a full unpickler and no option for one.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import torch

from gpt2port import inputs
from gpt2port.errors import GPT2PortError
from gpt2port.formats.base import LFS_POINTER_PREFIX, Reader, TensorInfo, refuse_lfs_pointer

ZIP_MAGIC = b"PK\x03\x04"  # a zip file's first local header: how torch.load itself tells its two formats apart


class PickleReader(Reader):
    """A state dict of tensors: flat (pytorch_model.bin, a .pth of model.state_dict()), or a training checkpoint
    that keeps it under "model" beside the optimizer's state (nanoGPT's ckpt.pt; its "model_args", a dict, are kept
    as model_args for readers.torch_pickle to read the model's sizes from). Memory-mapped where the file allows it
    (zip format), so reading a tensor touches only its pages."""

    model_args: dict | None = None

    def __init__(self, path: Path):
        self.path = Path(path)
        self.files = [self.path]
        self._state, self.model_args = _unwrap(load_state_dict(self.path), self.path)
        for k, v in self._state.items():
            _refuse_unbacked(self.path, k, v)
        self.tensors = {k: TensorInfo(k, v.dtype, tuple(v.shape), self.path, n, v.numel() * v.element_size())
                        for n, (k, v) in enumerate(self._state.items())}
        self.metadata = {}

    def read(self, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        return self._state[name]

    def close(self) -> None:
        self._state = {}


def load_state_dict(file: Path) -> dict[str, torch.Tensor]:
    """torch.load with weights_only=True: tensors and plain containers only, so a hostile pickle cannot run code."""
    with inputs.open_binary(file, what="a PyTorch pickle") as f:
        head = f.read(len(LFS_POINTER_PREFIX))
    refuse_lfs_pointer(file, head)
    zipped = head.startswith(ZIP_MAGIC)  # torch.save's zip format maps; the legacy one (a bare pickle) cannot
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols on stderr; the error says it all
            warnings.simplefilter("ignore")
            sd = torch.load(inputs.checked(file), map_location="cpu", weights_only=True, mmap=zipped)
    except pickle.UnpicklingError:
        # torch's own message invites the user to retry with weights_only=False: exactly what must not be done
        # with a file that asks for arbitrary globals. Name what it asks for instead.
        refused = _unsafe_globals(file) if zipped else []
        detail = f" (it asks for {', '.join(refused)})" if refused else ""
        raise GPT2PortError(f"{file}: refused: not plain tensors{detail}; gpt2port loads .bin files with "
                            f"torch.load(weights_only=True), which never runs code from a pickle") from None
    except Exception as e:  # noqa: BLE001 - torch raises many types for bad pickles; all mean "unreadable"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GPT2PortError(f"{file}: cannot be loaded as weights ({first})") from None
    if not isinstance(sd, dict):
        raise GPT2PortError(f"{file}: is not a state dict of tensors")
    return sd


def _refuse_unbacked(file: Path, name: str, t: torch.Tensor) -> None:
    """A tensor is dense and holds no more elements than its stored bytes: a pickle may describe a sparse tensor, or
    a view with stride 0 whose 1 stored number stands for 2**36 of them, and converting either would allocate what
    its shape claims (hundreds of GB) from a file of a few bytes."""
    if t.layout != torch.strided or t.is_meta:
        kind = "a meta" if t.is_meta else str(t.layout).removeprefix("torch.")
        raise GPT2PortError(f"{file}: tensor {name!r} is {kind} tensor; weights are dense tensors")
    stored = t.untyped_storage().nbytes()
    if t.numel() * t.element_size() > stored:
        raise GPT2PortError(f"{file}: tensor {name!r} of shape {list(t.shape)} claims {t.numel() * t.element_size():,} "
                            f"bytes, but stores {stored:,} (strides {list(t.stride())}: a view repeating its data)")


def _flat(sd) -> bool:
    return isinstance(sd, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items())


def _unsafe_globals(file: Path) -> list[str]:
    """The globals a refused zip-format pickle asks for, read without running it (torch's static scan)."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except Exception:  # noqa: BLE001 - only the detail of a refusal already decided; the refusal stands without it
        return []


def _unwrap(sd: dict, file: Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """(the tensors, the "model_args" dict beside them or None) of a loaded pickle: a flat state dict as it is, or a
    training checkpoint's "model"."""
    if _flat(sd):
        return sd, None
    if not _flat(sd.get("model")):
        raise GPT2PortError(f"{file}: is neither a flat state dict of tensors nor a training checkpoint holding one "
                            f"under \"model\" (it has {', '.join(map(str, list(sd)[:6]))})")
    args = sd.get("model_args")
    return sd["model"], args if isinstance(args, dict) else None
