"""`gpt2port export`: a converted checkpoint re-written in another dtype, or back in Hugging Face's layout.

Both ways stream one tensor at a time through writer.stream_safetensors; the way back inverts keymap's table, so a
fine-tuned model returns to the ecosystem as a directory GPT2LMHeadModel.from_pretrained loads as is.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2port import __version__
from gpt2port.checkpoint import (CONFIG, DTYPE_LABELS, MANIFEST, WEIGHTS, check_weights, config_json, parse_dtype,
                                 read_config, read_manifest, resolve)
from gpt2port.errors import GPT2PortError
from gpt2port.keymap import FORMAT_TAG, apply, plan_ours_to_hf
from gpt2port.safetensors_format import read_tensor
from gpt2port.sources import TOKENIZER_FILES
from gpt2port.writer import copy_file, staged_directory, stream_safetensors, write_json

HF_METADATA = {"format": "pt"}  # what save_pretrained writes


@dataclass
class ExportResult:
    out: Path
    dtype: torch.dtype
    bytes_written: int


def export(ckpt, out, to: str = "gpt2port", dtype=None, force: bool = False, progress=None) -> ExportResult:
    ckpt_dir = resolve(ckpt)
    out = Path(out)
    out_abs, ckpt_abs = out.resolve(), ckpt_dir.resolve()
    # Around it counts too: `--out checkpoints --force` would replace the directory holding the checkpoint.
    if out_abs == ckpt_abs or ckpt_abs in out_abs.parents or out_abs in ckpt_abs.parents:
        raise GPT2PortError(f"{out}: output must not be the checkpoint itself, inside it or around it ({ckpt_dir})")
    config = read_config(ckpt_dir)
    header = check_weights(ckpt_dir / WEIGHTS, config)
    out_dtype = parse_dtype(dtype) or header.entries["tok_emb.weight"].dtype
    if to == "hf":
        mappings = plan_ours_to_hf(config)
        metadata = HF_METADATA
    elif to == "gpt2port":
        mappings = None
        metadata = dict(FORMAT_TAG)
    else:
        raise GPT2PortError(f"unknown export layout {to!r} (use gpt2port or hf)")

    with open(ckpt_dir / WEIGHTS, "rb") as f:
        def produce(name, transform=None):
            return lambda: apply(transform, read_tensor(f, header.entries[name]))

        if mappings is None:
            items = [(name, out_dtype, e.shape, produce(name)) for name, e in header.entries.items()]
        else:
            items = [(m.target, out_dtype, tuple(reversed(header.entries[m.source].shape)) if m.transform
                      else header.entries[m.source].shape, produce(m.source, m.transform)) for m in mappings]
        with staged_directory(out, force) as stage:
            stream_safetensors(stage / WEIGHTS, items, metadata, progress)
            if to == "hf":
                write_json(stage / CONFIG, {**config.to_hf_config(), "dtype": str(out_dtype).removeprefix("torch.")})
            else:
                write_json(stage / CONFIG, config_json(config))
                write_json(stage / MANIFEST, _manifest(ckpt_dir, out_dtype))
            for name in TOKENIZER_FILES:
                if (ckpt_dir / name).is_file():
                    copy_file(ckpt_dir / name, stage / name)
    return ExportResult(out, out_dtype, (out / WEIGHTS).stat().st_size)


def _manifest(ckpt_dir: Path, dtype: torch.dtype) -> dict:
    """The source checkpoint's provenance, plus a note of this export."""
    manifest = read_manifest(ckpt_dir)
    history = manifest.get("exports", [])
    history.append({"from": str(ckpt_dir.resolve()), "dtype": DTYPE_LABELS[dtype], "version": __version__,
                    "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
    return {**manifest, "dtype": DTYPE_LABELS[dtype], "exports": history}
