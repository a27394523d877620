"""A converted gpt2port checkpoint directory: where it is, what it holds, and loading it into GPT fast.

Layout: model.safetensors (gpt2port keys, tied head stored once, metadata tag), config.json (GPTConfig fields
plus a format tag), the tokenizer files, manifest.json (provenance).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gpt2port.config import GPTConfig, canonical_name, is_known_name, read_json
from gpt2port.errors import GPT2PortError
from gpt2port.keymap import FORMAT_TAG, OURS_HEAD, expected_shapes
from gpt2port.safetensors_format import FLOAT_DTYPES, mmap_tensors, read_header

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
MANIFEST = "manifest.json"
CONFIG_FORMAT = "gpt2port"
DEFAULT_ROOT = Path("checkpoints")

DTYPE_ARGS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
              "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_LABELS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = DTYPE_ARGS.get(dtype.lower())
    if found is None:
        raise GPT2PortError(f"unknown dtype {dtype!r} (use fp32, fp16 or bf16)")
    return found


def default_dir(name: str) -> Path:
    root = Path(os.environ.get("GPT2PORT_CHECKPOINTS", DEFAULT_ROOT))
    return root / canonical_name(name)


def resolve(ckpt: str | Path) -> Path:
    """A checkpoint directory from a path, or from a model NAME (-> ./checkpoints/NAME)."""
    path = Path(ckpt)
    if path.is_dir():
        if not (path / WEIGHTS).is_file() or not (path / CONFIG).is_file():
            raise GPT2PortError(f"{path}: not a gpt2port checkpoint (needs {WEIGHTS} and {CONFIG}; "
                                f"for a Hugging Face directory run `gpt2port convert {path} --out DIR` first)")
        return path
    if is_known_name(str(ckpt)):
        found = default_dir(str(ckpt))
        if found.is_dir():
            return resolve(found)
        raise GPT2PortError(f"{found}: no converted checkpoint for {ckpt!r} (run `gpt2port download {ckpt}`)")
    if path.exists():
        raise GPT2PortError(f"{path}: is a file; a checkpoint is a directory")
    raise GPT2PortError(f"{path}: no such checkpoint directory")


def read_config(ckpt_dir: Path) -> GPTConfig:
    data = read_json(ckpt_dir / CONFIG)
    if data.get("format") != CONFIG_FORMAT:
        raise GPT2PortError(f"{ckpt_dir / CONFIG}: not a gpt2port config (no \"format\": \"{CONFIG_FORMAT}\")")
    try:
        return GPTConfig.from_dict(data["model"])
    except (KeyError, TypeError):
        raise GPT2PortError(f"{ckpt_dir / CONFIG}: has no valid \"model\" section") from None


def config_json(config: GPTConfig) -> dict:
    return {"format": CONFIG_FORMAT, "format_version": 1, "model": config.to_dict()}


def read_manifest(ckpt_dir: Path) -> dict:
    path = ckpt_dir / MANIFEST
    return read_json(path) if path.is_file() else {}


def check_weights(path: Path, config: GPTConfig):
    """Header of a gpt2port weights file, checked against the config: every parameter, right shape, float."""
    header = read_header(path)
    if header.metadata.get("gpt2port_format") != FORMAT_TAG["gpt2port_format"]:
        raise GPT2PortError(f"{path}: not in gpt2port layout (metadata gpt2port_format="
                            f"{header.metadata.get('gpt2port_format')!r})")
    expected = expected_shapes(config)
    missing = [k for k in expected if k not in header.entries]
    extra = [k for k in header.entries if k not in expected]
    if missing or extra:
        raise GPT2PortError(f"{path}: keys do not match config.json (missing: {missing[:5]}, unexpected: {extra[:5]})")
    for k, shape in expected.items():
        e = header.entries[k]
        if e.shape != shape:
            raise GPT2PortError(f"{path}: tensor {k!r} has shape {e.shape}, config.json implies {shape}")
        if e.dtype not in FLOAT_DTYPES:
            raise GPT2PortError(f"{path}: tensor {k!r} has non-float dtype {e.dtype}")
    return header


def load_state_dict(ckpt_dir: Path, config: GPTConfig, dtype=None, device=None) -> dict[str, torch.Tensor]:
    """Tensors memory-mapped from the file; converted only if a dtype or device is asked for."""
    header = check_weights(ckpt_dir / WEIGHTS, config)
    tensors = mmap_tensors(header)
    if dtype is not None or device is not None:
        tensors = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
    return tensors


def load_model(ckpt, dtype=None, device=None):
    """Build GPT on the meta device (no init of any weight) and assign the mapped tensors into it."""
    from gpt2port.model import GPT

    ckpt_dir = resolve(ckpt)
    config = read_config(ckpt_dir)
    state = load_state_dict(ckpt_dir, config, parse_dtype(dtype), device)
    with torch.device("meta"):
        model = GPT(config)
    state[OURS_HEAD] = state["tok_emb.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    model.lm_head.weight = model.tok_emb.weight  # assign made two Parameters of one tensor; make them one
    return model.eval()
