"""What a --device argument may name: checked before anything is loaded onto it."""

from __future__ import annotations

import torch

from gpt2port.errors import GPT2PortError


def check_device(device: str | None) -> None:
    """A device torch knows and this machine has, or a refusal naming the argument: torch's own refusal of "bogus"
    is a RuntimeError, which would read as a bug."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise GPT2PortError(f"--device {device}: not a device name (cpu, cuda, cuda:N, ...)") from None
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, ValueError, AssertionError) as e:
        reason = " ".join(str(e).split())[:160] or type(e).__name__
        raise GPT2PortError(f"--device {device}: not available on this machine ({reason})") from None
