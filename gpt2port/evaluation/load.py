"""A model to evaluate, from anything gpt2port reads, and the one place that calls it.

A gpt2port checkpoint (or a NAME) loads with GPT.from_pretrained (gpt2port.fast.int4's, which adds int4) as
`generate` loads it. Any other source (a Hugging Face directory, an llm.c file, a GGUF file including q8_0, nanoGPT's
ckpt.pt) is converted first, into a private temporary directory, by the same conversion `gpt2port convert` runs (with
its checks), then loaded the same way; the directory is removed once the model is loaded (a mapped file outlives its
name on POSIX systems).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2port.checkpoint import CONFIG, CONFIG_FORMAT, is_checkpoint, load_tokenizer
from gpt2port.devices import check_device
from gpt2port.dtypes import QUANTIZED
from gpt2port.errors import GPT2PortError
from gpt2port.inputs import read_json
from gpt2port.fast import Settings, accelerate
from gpt2port.fast import int4
from gpt2port.fsio import temp_directory
from gpt2port.model import GPT

# The products of many rows on the kernel generation's prefill uses (oneDNN for fp32 on the CPU: on this project's
# CPUs it runs ~15% faster than F.linear's MKL, the same products to float rounding); no one-row kernel to build,
# no capture (evaluation runs no decode steps).
PRODUCTS = Settings(native=False, attend_one=False, cuda_graph=False)


@dataclass
class Loaded:
    model: GPT
    tokenizer: object  # tiktoken.Encoding
    name: str  # as the user named it
    dtype: str
    device: str
    notes: list[str]


def logits(model: GPT, idx: torch.Tensor, cache=None, pos: int = 0, keep: int | torch.Tensor = 0) -> torch.Tensor:
    """(B, T) token ids (at positions pos.. of the cache, if one) -> (B, T, vocab) logits, or only those `keep` says
    (the forward's logits_to_keep: the last k, or (B, K) positions per row): every call of a model in evaluation
    goes through here."""
    return model(idx, cache=cache, pos=pos, logits_to_keep=keep)[0]


def pick_device(device: str | None, dtype: str | None) -> str:
    device = device or ("cuda" if torch.cuda.is_available() and dtype not in QUANTIZED else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GPT2PortError(f"--device {device}: CUDA is not available on this machine")
    check_device(device)
    return device


def load(ckpt: str, dtype: str | None, device: str, role: str = "the model") -> Loaded:
    """The model at `ckpt` in `dtype` (None: the file's) on `device`, with its tokenizer; refused if its weights
    hold NaN or Inf (role: which model it is, in the refusal)."""
    from gpt2port.dtypes import label

    path = Path(ckpt)
    if _gpt2port(path) or not path.exists():  # a checkpoint directory, or a NAME under ./checkpoints
        model = int4.from_pretrained(ckpt, dtype=dtype, device=device)
        tokenizer, notes = load_tokenizer(model.checkpoint_dir), []
    else:
        from gpt2port.conversion import convert

        scratch = temp_directory("gpt2port-eval")  # a killed run's is swept by the next
        try:
            result = convert(path, scratch / "model")
            model = int4.from_pretrained(scratch / "model", dtype=dtype, device=device)
            tokenizer = load_tokenizer(scratch / "model")
            model.checkpoint_dir = None
            notes = [f"{ckpt}: converted for this run ({w})" for w in result.warnings]
            if result.dequantized:  # what is scored: the values the file holds, not the model before quantization
                notes.append(f"{ckpt}: its {result.dequantized} weights dequantized to fp32 for this run")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    _refuse_non_finite(model, ckpt, role)
    accelerate(model, PRODUCTS)
    shown = dtype or label(model.pos_emb.weight.dtype)
    return Loaded(model, tokenizer, str(ckpt), shown, device, notes)



def _refuse_non_finite(model: GPT, ckpt: str, role: str) -> None:
    """No figure is computed from weights holding NaN or Inf: every log-likelihood would be NaN, or worse, some."""
    from gpt2port.conversion import all_finite

    bad = [name for name, p in model.named_parameters() if p.is_floating_point() and not all_finite(p.detach())]
    if bad:
        shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise GPT2PortError(f"{ckpt}: NaN or Inf in {role}'s weights ({shown}); no figure can be computed from them")


def _gpt2port(path: Path) -> bool:
    """A gpt2port checkpoint directory (a Hugging Face one has the same two file names; its config says otherwise)."""
    return is_checkpoint(path) and read_json(path / CONFIG).get("format") == CONFIG_FORMAT
