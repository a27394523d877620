"""What `gpt2port finetune --lora` adds to a run: the check of its options, the adapters attached to the freshly
built model (base frozen), and at the end the adapter written in peft's format beside the merged checkpoint.

The training itself is finetune's, unchanged: the optimizer and clipping see only parameters that require
gradients, and the training state (train_state/) holds only those (training/state.py), not the frozen base.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from gpt2port.config import GPTConfig
from gpt2port.errors import GPT2PortError
from gpt2port.lora import held, layer
from gpt2port.lora.spec import Spec, spec

ADAPTER = "adapter"  # the run directory's peft adapter


def check(s, config: GPTConfig, fsdp: bool = False) -> Spec | None:
    """The checked LoRA spec of finetune Settings `s` (None for a full fine-tune)."""
    found = spec(s.lora, s.lora_alpha, s.lora_targets, s.lora_split_qkv, s.lora_dropout, config)
    base_dtype = getattr(s, "lora_base_dtype", "fp32")
    if base_dtype not in held.DTYPES:
        raise GPT2PortError(f"--lora-base-dtype {base_dtype}: must be one of {', '.join(held.DTYPES)}")
    if found is None and base_dtype != "fp32":
        raise GPT2PortError("--lora-base-dtype: LoRA options need --lora RANK")
    if base_dtype != "fp32" and fsdp:
        raise GPT2PortError(f"--lora-base-dtype {base_dtype} with --fsdp: not supported (FSDP shards the fp32 base "
                            f"instead; the two do not combine)")
    return found


def attach(model: torch.nn.Module, s, config: GPTConfig, quiet: bool = True, weights: dict | None = None):
    """Freeze `model` and attach the adapters `s` asks for, initialised from the run's seed, the same on every
    rank (a resumed run then loads its saved ones over them). Says what is trained on stderr unless quiet.
    With `weights` (FSDP: `model` still on the meta device, dist.build) returns what fills it."""
    found = check(s, config)
    if found is None:
        return weights
    swapped = layer.attach(model, found, torch.Generator().manual_seed(s.seed))
    if weights is not None:
        weights = layer.sharded_weights(model, weights, torch.Generator().manual_seed(s.seed))
    base_dtype = getattr(s, "lora_base_dtype", "fp32")
    if base_dtype != "fp32":
        held.hold_(model, held.DTYPES[base_dtype])
    if not quiet:
        trained = sum(p.numel() for m in swapped.values() for p in (m.lora_A, m.lora_B))
        total = sum(p.numel() for p in model.parameters())
        how = "in fp32" if base_dtype == "fp32" else f"with its matrices held in {base_dtype} (computed in fp32)"
        print(f"LoRA rank {found.rank} (alpha {found.alpha:g}) on {', '.join(found.targets)}"
              f"{' (q, k, v apart)' if found.split_qkv else ''}: {trained:,} trained parameters, the "
              f"{total - trained:,} of the base frozen {how}", file=sys.stderr)
    return weights


def meta_model(config: GPTConfig, settings: dict, fields) -> torch.nn.Module:
    """The model a saved training state must fit, without memory: a GPT of `config` with the adapters its saved
    `settings` ask for (those a state from before LoRA lacks taken as the defaults of the dataclass `fields`)."""
    import dataclasses
    from types import SimpleNamespace

    from gpt2port.model import GPT

    s = SimpleNamespace(**{f.name: settings.get(f.name, f.default) for f in dataclasses.fields(fields)})
    with torch.device("meta"):
        model = GPT(config)
        found = check(s, config)
        if found is not None:
            layer.attach(model, found)
    return model


def finish(model: torch.nn.Module, config: GPTConfig, s, base: Path) -> dict:
    """Take the adapters out of `model` ({module: (A, B, scaling)}), then merge them into its weights in place,
    checked (logits before and after). Returns what finish_files and the manifest need."""
    inner = getattr(model, "module", model)
    if held.is_held(inner):  # trained over the base rounded to bf16; merged into the checkpoint's own weights
        from gpt2port.checkpoint import load_state

        held.restore_(inner, load_state(base, dtype=torch.float32)[2])
    deltas = layer.deltas_of(inner)
    diff = layer.merge_checked(inner, layer.probe_ids(config))
    return {"deltas": deltas, "merge_check": diff, "base": str(base), "dropout": s.lora_dropout}


def write(stage: Path, out: Path, taken: dict) -> None:
    """The adapter into the checkpoint being staged (stage/adapter), replacing one a killed finish left in out."""
    shutil.rmtree(Path(out) / ADAPTER, ignore_errors=True)
    (stage / ADAPTER).mkdir()
    from gpt2port.lora.peft import write_adapter

    write_adapter(stage / ADAPTER, taken["deltas"], taken["base"], taken["dropout"])
