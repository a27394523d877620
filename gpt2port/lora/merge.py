"""`gpt2port merge BASE ADAPTER --out DIR`: a peft LoRA adapter (made by `finetune --lora` or by peft elsewhere)
folded into a gpt2port checkpoint, proven, and written by the same writer as every checkpoint.

The adapter is read and checked against the base before anything is built; the base is loaded memory-mapped in
fp32, the adapters attached, the logits of a fixed probe taken, the adapters merged into the weights in place (the
file is mapped copy-on-write: never written), the logits taken again and compared (layer.merge_checked), and only
then is the checkpoint staged, checked and renamed into place (fsio).
"""

from __future__ import annotations

from pathlib import Path

import torch

from gpt2port.checkpoint import read_config, resolve, save_state
from gpt2port.fsio import refuse_overlap, refuse_replacing_reads
from gpt2port.hashing import hash_file
from gpt2port.lora import layer
from gpt2port.lora.peft import CONFIG, WEIGHTS, read_adapter


def merge(base, adapter, out, force: bool = False, dtype=None) -> tuple[Path, float]:
    """Merge the peft adapter directory `adapter` into checkpoint `base` (a directory or NAME), written to `out`
    (fp32 unless dtype says otherwise). Returns (out, the merge check's relative logit difference)."""
    from gpt2port.model import GPT

    out, adapter = Path(out), Path(adapter)
    ckpt_dir = resolve(base)
    config = read_config(ckpt_dir)
    deltas, _ = read_adapter(adapter, config)  # refuses a bad or foreign adapter before anything is built
    refuse_overlap(out, adapter, "the adapter")
    refuse_replacing_reads(out, [adapter / CONFIG, adapter / WEIGHTS])
    model = GPT.from_pretrained(ckpt_dir, dtype=torch.float32)
    layer.attach_deltas(model, deltas)
    diff = layer.merge_checked(model, layer.probe_ids(config))
    record = {"merged_adapter": {"path": str(adapter.resolve()), "modules": len(deltas),
                                 "sha256": hash_file(adapter / WEIGHTS)[0], "merge_check": diff}}
    save_state(model.state_dict(), config, out, dtype=dtype or torch.float32, force=force, origin=ckpt_dir,
               kind="merged LoRA", record=record)
    return out, diff
