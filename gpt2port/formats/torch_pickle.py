"""PyTorch's pickled state dicts (pytorch_model.bin, .pt, .pth), loaded only with torch.load(weights_only=True).

Unpickling can run arbitrary code, so a pickle is loaded only by the restricted unpickler that accepts tensors and
plain containers and refuses everything else. There is no fallback to a full unpickler and no option for one.
"""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path

import torch

from gpt2port.errors import GPT2PortError
from gpt2port.formats.base import LFS_POINTER_PREFIX, Reader, TensorInfo, refuse_lfs_pointer


class PickleReader(Reader):
    """A flat state dict of tensors. Memory-mapped where the file allows it (zip format), so reading a tensor
    touches only its pages."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.files = [self.path]
        self._state = load_state_dict(self.path)
        self.tensors = {k: TensorInfo(k, v.dtype, tuple(v.shape), self.path, n, v.numel() * v.element_size())
                        for n, (k, v) in enumerate(self._state.items())}
        self.metadata = {}

    def read(self, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        return self._state[name]

    def close(self) -> None:
        self._state = {}


def load_state_dict(file: Path) -> dict[str, torch.Tensor]:
    """torch.load with weights_only=True: tensors and plain containers only, so a hostile pickle cannot run code."""
    with open(file, "rb") as f:
        refuse_lfs_pointer(file, f.read(len(LFS_POINTER_PREFIX)))
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols on stderr; the error says it all
            warnings.simplefilter("ignore")
            try:
                sd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):  # legacy (pre-zip) format cannot be mapped; load it normally
                    raise
                sd = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's own message invites the user to retry with weights_only=False: exactly what must not be done
        # with a file that asks for arbitrary globals. Keep only the refused instruction.
        found = re.search(r"WeightsUnpickler error:\s*(.+?)(?: was not an allowed global|\n|$)", str(e))
        detail = found.group(1).strip() if found else "not plain tensors"
        raise GPT2PortError(f"{file}: refused: not plain tensors ({detail}); gpt2port loads .bin files with "
                            f"torch.load(weights_only=True), which never runs code from a pickle") from None
    except Exception as e:  # noqa: BLE001 - torch raises many types for bad pickles; all mean "unreadable"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GPT2PortError(f"{file}: cannot be loaded as weights ({first})") from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise GPT2PortError(f"{file}: is not a flat state dict of tensors")
    return sd
