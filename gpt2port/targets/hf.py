"""The hf target: what GPT2LMHeadModel.from_pretrained loads as is."""

from __future__ import annotations

from gpt2port import checkpoint
from gpt2port.formats.safetensors import stream_safetensors
from gpt2port.fsio import copy_file, write_json
from gpt2port.layouts import HF


def write(job) -> int:
    """The writer for "hf" (job: a conversion.Job): safetensors weights, its config.json, the tokenizer."""
    with job.staged() as stage:
        stream_safetensors(stage / checkpoint.WEIGHTS, job.items, dict(HF.metadata), job.progress)
        write_json(stage / checkpoint.CONFIG, {**job.source.config.to_hf_config(),
                                               "dtype": str(job.dtype).removeprefix("torch.")})
        for f in job.source.tokenizer_files():
            copy_file(f, stage / f.name)
        size = (stage / checkpoint.WEIGHTS).stat().st_size
        job.write_manifest(stage, "hf")
    return size
