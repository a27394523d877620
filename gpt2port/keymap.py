"""THE key map between Hugging Face GPT-2 tensors and gpt2port's parameters, usable in both directions.

One row per tensor kind; `{}` stands for the layer index. HF's Conv1D stores weights as (in, out), nn.Linear
as (out, in), so those rows carry TRANSPOSE: the square attn.c_proj would pass any shape check untransposed,
which is why this table, not shapes, decides. Keys that exist in HF files but are not parameters are dropped
by name, never by a catch-all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from gpt2port.config import GPTConfig
from gpt2port.errors import GPT2PortError

TRANSPOSE = "transpose"

# (HF key, gpt2port key, transform). HF keys are the bare hub names; `transformer.` prefixes are stripped first.
KEYMAP: list[tuple[str, str, str | None]] = [
    ("wte.weight", "tok_emb.weight", None),
    ("wpe.weight", "pos_emb.weight", None),
    ("h.{}.ln_1.weight", "blocks.{}.ln1.weight", None),
    ("h.{}.ln_1.bias", "blocks.{}.ln1.bias", None),
    ("h.{}.attn.c_attn.weight", "blocks.{}.attn.qkv.weight", TRANSPOSE),
    ("h.{}.attn.c_attn.bias", "blocks.{}.attn.qkv.bias", None),
    ("h.{}.attn.c_proj.weight", "blocks.{}.attn.proj.weight", TRANSPOSE),
    ("h.{}.attn.c_proj.bias", "blocks.{}.attn.proj.bias", None),
    ("h.{}.ln_2.weight", "blocks.{}.ln2.weight", None),
    ("h.{}.ln_2.bias", "blocks.{}.ln2.bias", None),
    ("h.{}.mlp.c_fc.weight", "blocks.{}.mlp.fc.weight", TRANSPOSE),
    ("h.{}.mlp.c_fc.bias", "blocks.{}.mlp.fc.bias", None),
    ("h.{}.mlp.c_proj.weight", "blocks.{}.mlp.proj.weight", TRANSPOSE),
    ("h.{}.mlp.c_proj.bias", "blocks.{}.mlp.proj.bias", None),
    ("ln_f.weight", "final_norm.weight", None),
    ("ln_f.bias", "final_norm.bias", None),
]

# Causal-mask buffers that 2019-era hub files carry per layer; the model rebuilds the mask, so they carry nothing.
DROPPED = {"h.{}.attn.bias", "h.{}.attn.masked_bias"}

# The head: tied to wte in GPT-2. Accepted in a source only when it equals wte; never written by gpt2port.
HF_HEAD = "lm_head.weight"
HF_EMBEDDING = "wte.weight"
OURS_HEAD = "lm_head.weight"

HF_PREFIX = "transformer."
FORMAT_TAG = {"format": "pt", "gpt2port_format": "gpt2port/v1"}  # safetensors metadata of our files

_TO_OURS = {hf: (ours, t) for hf, ours, t in KEYMAP}
_TO_HF = {ours: (hf, t) for hf, ours, t in KEYMAP}
_LAYER_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")


def _template(key: str) -> tuple[str, int | None]:
    """'h.7.attn.c_attn.weight' -> ('h.{}.attn.c_attn.weight', 7)."""
    m = _LAYER_INDEX.search(key)
    if m is None:
        return key, None
    return key[: m.start()] + "{}" + key[m.end():], int(m.group())


def strip_prefix(hf_key: str) -> str:
    return hf_key[len(HF_PREFIX):] if hf_key.startswith(HF_PREFIX) else hf_key


@dataclass(frozen=True)
class Mapping:
    source: str  # key as it appears in the source file
    target: str  # key on the other side
    transform: str | None


def plan_hf_to_ours(source_keys, config: GPTConfig, where: str) -> tuple[list[Mapping], list[str], str | None]:
    """Decide the fate of every HF source key: mapped, dropped, or (lm_head) checked against wte.

    Returns (mappings, dropped keys, head key or None). Raises, naming the keys and `where`, if any source key is
    unknown or duplicated, or any target parameter would be missing.
    """
    mappings, dropped, head, unknown, seen = [], [], None, [], {}
    for key in source_keys:
        bare = strip_prefix(key)
        if bare == HF_HEAD:
            head = key
            continue
        template, layer = _template(bare)
        if layer is not None and layer >= config.n_layer:
            unknown.append(key)
        elif template in DROPPED:
            dropped.append(key)
        elif template in _TO_OURS:
            ours, transform = _TO_OURS[template]
            target = ours.format(layer) if layer is not None else ours
            if target in seen:
                raise GPT2PortError(f"{where}: keys {seen[target]!r} and {key!r} both hold {bare!r}")
            seen[target] = key
            mappings.append(Mapping(key, target, transform))
        else:
            unknown.append(key)
    if unknown:
        raise GPT2PortError(f"{where}: unexpected keys: {_short_list(unknown)}")
    missing = [k for k in expected_keys(config) if k not in seen]
    if missing:
        missing_hf = [hf_key_for(k) for k in missing]
        raise GPT2PortError(f"{where}: missing keys: {_short_list(missing_hf)}")
    return mappings, dropped, head


def hf_key_for(ours_key: str) -> str:
    template, layer = _template(ours_key)
    hf, _ = _TO_HF[template]
    return hf.format(layer) if layer is not None else hf


def plan_ours_to_hf(config: GPTConfig, prefix: str = HF_PREFIX) -> list[Mapping]:
    """The inverse table, for export back to HF's layout (today's save_pretrained naming by default)."""
    return [Mapping(k, prefix + hf_key_for(k), _TO_HF[_template(k)[0]][1]) for k in expected_keys(config)]


def expected_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every gpt2port parameter stored in a file, with its shape (nn.Linear layout). The tied head is not stored."""
    C, F, V, P = config.n_embd, config.mlp_width, config.vocab_size, config.n_positions
    per_layer = {
        "ln1.weight": (C,), "ln1.bias": (C,),
        "attn.qkv.weight": (3 * C, C), "attn.qkv.bias": (3 * C,),
        "attn.proj.weight": (C, C), "attn.proj.bias": (C,),
        "ln2.weight": (C,), "ln2.bias": (C,),
        "mlp.fc.weight": (F, C), "mlp.fc.bias": (F,),
        "mlp.proj.weight": (C, F), "mlp.proj.bias": (C,),
    }
    shapes = {"tok_emb.weight": (V, C), "pos_emb.weight": (P, C)}
    for i in range(config.n_layer):
        shapes.update({f"blocks.{i}.{name}": shape for name, shape in per_layer.items()})
    shapes.update({"final_norm.weight": (C,), "final_norm.bias": (C,)})
    return shapes


def expected_keys(config: GPTConfig) -> list[str]:
    return list(expected_shapes(config))


def apply(transform: str | None, tensor: torch.Tensor) -> torch.Tensor:
    """The transform is its own inverse, so the same call serves both directions."""
    return tensor.t() if transform == TRANSPOSE else tensor


def source_shape(mapping: Mapping, target_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(reversed(target_shape)) if mapping.transform == TRANSPOSE else tuple(target_shape)


def _short_list(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")
