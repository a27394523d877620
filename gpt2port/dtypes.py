"""The dtypes a checkpoint may hold, by the names users type."""

from __future__ import annotations

import torch

from gpt2port.errors import GPT2PortError

DTYPE_ARGS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
              "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_LABELS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# Computed in with the matrices quantized at load, on the CPU only (gpt2port.quant, gpt2port.quant4)
QUANTIZED = ("int8", "int4")


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = DTYPE_ARGS.get(dtype.lower())
    if found is None:
        raise GPT2PortError(f"unknown dtype {dtype!r} (use fp32, fp16 or bf16)")
    return found


def label(dtype: torch.dtype) -> str:
    return DTYPE_LABELS.get(dtype, str(dtype).removeprefix("torch."))
