"""`gpt2port export ADAPTER --to gguf`: a peft LoRA adapter of GPT-2 as llama.cpp's LoRA adapter GGUF, for
`llama-cli -m model.gguf --lora adapter.gguf` (or llama-cpp-python's lora_path) over a `gpt2port export --to gguf`.

What llama.cpp's loader reads: general.type "adapter", general.architecture the base's ("gpt2"), adapter.type
"lora", adapter.lora.alpha; then per adapted matrix `<base tensor>.lora_a` (rank, in) and `.lora_b` (out, rank)
as numpy shapes (ggml lists dimensions the other way round), the base tensor's name from layouts/gguf.py. llama.cpp
scales each by alpha / rank, rank read from that matrix's lora_b: a module whose scaling is another (peft's
alpha_pattern, rsLoRA, gpt2port's split q|k|v at rank 3r) has the difference folded into its lora_b.
"""

from __future__ import annotations

from pathlib import Path

import gguf

from gpt2port.checkpoint import write_export_manifest
from gpt2port.errors import GPT2PortError
from gpt2port.formats.gguf import ENCODINGS, write_gguf
from gpt2port.fsio import refuse_overlap, staged_directory
from gpt2port.layouts import GGUF
from gpt2port.layouts.gguf import ARCH
from gpt2port.lora.peft import CONFIG, WEIGHTS, read_adapter

FILE_NAME = "adapter.gguf"


def export_adapter(adapter, out, dtype: str | None = None, force: bool = False) -> tuple[Path, int]:
    """Write the peft adapter directory `adapter` as `out`/adapter.gguf (with a manifest). Returns (out, bytes)."""
    adapter, out = Path(adapter), Path(out)
    label = dtype or "fp32"
    if label not in ("fp32", "fp16"):
        raise GPT2PortError(f"--dtype {label}: an adapter GGUF is written in fp32 or fp16")
    deltas, cfg = read_adapter(adapter)
    refuse_overlap(out, adapter, "the adapter")
    alpha = float(cfg.get("lora_alpha", 8))  # llama.cpp applies one alpha to every matrix: the adapter's own
    plan = []
    for name, (a, b, scaling) in deltas.items():
        key = GGUF.key_for(f"{name}.weight")
        fold = scaling * a.shape[0] / alpha  # 1.0 unless this module's scaling differs from alpha / its rank
        b = b if fold == 1.0 else b * fold
        plan.append((f"{key}.lora_a", tuple(a.shape), ENCODINGS[label], lambda t=a: t))
        plan.append((f"{key}.lora_b", tuple(b.shape), ENCODINGS[label], lambda t=b: t))

    def describe(writer: gguf.GGUFWriter) -> None:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        writer.add_name("GPT-2 LoRA adapter")

    with staged_directory(out, force, [adapter / CONFIG, adapter / WEIGHTS]) as stage:
        size = write_gguf(stage / FILE_NAME, ARCH, plan, describe)
        write_export_manifest(stage, "gguf-lora", {"source": {"path": str(adapter.resolve()), "kind": "peft LoRA",
                                                              "base": cfg.get("base_model_name_or_path")},
                                                   "adapter": {"alpha": alpha, "modules": len(deltas)}})
    return out, size
