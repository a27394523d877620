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

from gpt2port.checkpoint import MANIFEST, read_config, read_manifest, resolve, save_state
from gpt2port.checkpoint import WEIGHTS as WEIGHTS_FILE
from gpt2port.errors import GPT2PortError
from gpt2port.fsio import refuse_overlap, refuse_replacing_reads
from gpt2port.hashing import hash_file
from gpt2port.lora import layer
from gpt2port.lora.peft import CONFIG, WEIGHTS, read_adapter
from gpt2port.registry import ADAPTER_DIR


def merge(base, adapter, out, force: bool = False, dtype=None) -> tuple[Path, float]:
    """Merge the peft adapter directory `adapter` into checkpoint `base` (a directory or NAME), written to `out`
    (fp32 unless dtype says otherwise). Returns (out, the merge check's relative logit difference)."""
    from gpt2port.model import GPT

    out, adapter = Path(out), Path(adapter)
    ckpt_dir = resolve(base)
    config = read_config(ckpt_dir)
    deltas, _ = read_adapter(adapter, config)  # refuses a bad or foreign adapter before anything is built
    refuse_overlap(out, adapter, "the adapter")
    refuse_overlap(out, ckpt_dir, "the base checkpoint")  # the base is read, never replaced: not even with --force
    refuse_replacing_reads(out, [adapter / CONFIG, adapter / WEIGHTS, ckpt_dir / WEIGHTS_FILE, ckpt_dir / MANIFEST])
    sha256 = hash_file(adapter / WEIGHTS)[0]
    _refuse_merged_already(ckpt_dir, adapter, sha256)
    model = GPT.from_pretrained(ckpt_dir, dtype=torch.float32)
    layer.attach_deltas(model, deltas)
    diff = layer.merge_checked(model, layer.probe_ids(config))
    record = {"merged_adapter": {"path": str(adapter.resolve()), "modules": len(deltas),
                                 "sha256": sha256, "merge_check": diff}}
    save_state(model.state_dict(), config, out, dtype=dtype or torch.float32, force=force, origin=ckpt_dir,
               kind="merged LoRA", record=record)
    return out, diff


def _refuse_merged_already(ckpt_dir: Path, adapter: Path, sha256: str) -> None:
    """An adapter that the base's manifest says is in it already (merged by `merge`, or trained and merged by the
    `finetune --lora` run that made this checkpoint), by its weights' sha256: merged again, it would count twice."""
    manifest = read_manifest(ckpt_dir)
    merged = [s.get("merged_adapter") for s in manifest.get("saves", [])]
    trained = manifest.get("files", {}).get(f"{ADAPTER_DIR}/{WEIGHTS}")
    if any(isinstance(m, dict) and m.get("sha256") == sha256 for m in merged) or \
            (isinstance(trained, dict) and trained.get("sha256") == sha256):
        raise GPT2PortError(f"{adapter}: already merged into {ckpt_dir} ({ckpt_dir / MANIFEST} records this "
                            f"adapter, sha256 {sha256[:12]}…); merged again it would count twice")
