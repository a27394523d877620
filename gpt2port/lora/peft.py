"""An adapter directory in peft's format, both ways: adapter_config.json and adapter_model.safetensors, named as
peft names GPT2LMHeadModel's modules (base_model.model.transformer.h.0.attn.c_attn.lora_A.weight).

GPT-2's matrices are transformers' Conv1D, stored (in, out); peft marks that with fan_in_fan_out=True (it forces it
for Conv1D) and still stores lora_A as (rank, in) and lora_B as (out, rank), as for nn.Linear: the same A and B as
gpt2port's. In memory an adapter is {module: (A, B, scaling)}, module in gpt2port's names (blocks.0.attn.qkv).

gpt2port's split q, k, v (three rank-r adapters on c_attn) has no peft form of its own; it is written as the one
rank-3r c_attn adapter it equals (A the three A's stacked, B block-diagonal), with rank_pattern and alpha_pattern
giving c_attn its rank and the same scaling: peft loads it and computes the same logits.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from gpt2port import inputs
from gpt2port.config import GPTConfig
from gpt2port.errors import GPT2PortError
from gpt2port.formats import FLOAT_DTYPES
from gpt2port.formats.safetensors import mmap_tensors, read_header, stream_safetensors
from gpt2port.fsio import write_json
from gpt2port.lora import schema
from gpt2port.lora.spec import TARGETS

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# gpt2port's module in a block -> transformers' (GPT2LMHeadModel)
HF_MODULES = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
_OURS = {v: k for k, v in HF_MODULES.items()}
PREFIX = "base_model.model.transformer.h."
_KEY = re.compile(r"base_model\.model\.(?:transformer\.)?h\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)"
                  r"\.lora_([AB])\.weight")
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


def is_adapter(path) -> bool:
    return (Path(path) / CONFIG).is_file()


def hf_module(name: str) -> str:
    """blocks.3.attn.qkv -> transformer.h.3.attn.c_attn"""
    i, module = _BLOCK.fullmatch(name).groups()
    return f"transformer.h.{i}.{HF_MODULES[module]}"


# --- writing ------------------------------------------------------------------------------------------------------

def write_adapter(stage: Path, deltas: dict, base: str, dropout: float = 0.0) -> None:
    """adapter_config.json and adapter_model.safetensors of `deltas` into the existing directory `stage`."""
    ranks = {name: a.shape[0] for name, (a, _, _) in deltas.items()}
    alphas = {name: s * ranks[name] for name, (_, _, s) in deltas.items()}
    r = min(ranks.values())
    alpha = next(alphas[n] for n in deltas if ranks[n] == r)
    modules = sorted({_BLOCK.fullmatch(n).group(2) for n in deltas}, key=list(TARGETS.values()).index)
    # Modules whose rank or alpha differ from the common one (split q|k|v: c_attn at 3r, same scaling)
    rank_pattern = {HF_MODULES[m]: ranks[n] for n in deltas if ranks[n] != r
                    for m in [_BLOCK.fullmatch(n).group(2)]}
    alpha_pattern = {HF_MODULES[m]: alphas[n] for n in deltas if alphas[n] != alpha
                     for m in [_BLOCK.fullmatch(n).group(2)]}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": r,
              "lora_alpha": alpha, "target_modules": [HF_MODULES[m] for m in modules], "fan_in_fan_out": True,
              "lora_dropout": dropout, "bias": "none", "use_rslora": False, "use_dora": False,
              "modules_to_save": None, "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
              "inference_mode": True, "init_lora_weights": True}
    items = []
    for name, (a, b, _) in deltas.items():
        key = f"base_model.model.{hf_module(name)}"
        for part, t in (("A", a), ("B", b)):
            items.append((f"{key}.lora_{part}.weight", torch.float32, tuple(t.shape),
                          lambda t=t: t.detach().float().cpu().contiguous()))
    stream_safetensors(stage / WEIGHTS, items, {"format": "pt"})
    write_json(stage / CONFIG, config)
    back, _ = read_adapter(stage)  # read back as merge and peft will: the same tensors and scalings, bit for bit
    for name, (a, b, scaling) in deltas.items():
        a2, b2, s2 = back.get(name, (None, None, None))
        if a2 is None or not (torch.equal(a2, a.float().cpu()) and torch.equal(b2, b.float().cpu())) or \
                abs(s2 - scaling) > 1e-12 * scaling:
            raise GPT2PortError(f"{stage}: the adapter read back differs from what was written ({name})")


# --- reading ------------------------------------------------------------------------------------------------------

def read_adapter(path, config: GPTConfig | None = None) -> tuple[dict, dict]:
    """({module: (A, B, scaling)}, adapter_config) of a peft LoRA adapter of GPT-2, checked in full: its settings,
    every tensor's name, pairing and shape, and with `config` the base it is to be applied to (shapes named when
    they are another model's). One line on the first thing wrong."""
    path = Path(path)
    cfg_path, weights = path / CONFIG, path / WEIGHTS
    if not cfg_path.is_file():
        raise GPT2PortError(f"{path}: not a peft adapter directory (no {CONFIG})")
    cfg = inputs.read_json(cfg_path)
    settings = schema.check(cfg, cfg_path)
    if not weights.is_file():
        old = " (only adapter_model.bin, a pickle: save it with safe_serialization=True)" \
            if (path / "adapter_model.bin").is_file() else ""
        raise GPT2PortError(f"{path}: no {WEIGHTS}{old}")
    header = read_header(weights)
    found: dict[tuple[int, str], dict[str, tuple]] = {}
    for key, e in header.entries.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise GPT2PortError(f"{weights}: tensor {key!r} is not a LoRA A or B of GPT-2's c_attn, c_proj or c_fc "
                                f"(only those can be merged)")
        if e.dtype not in FLOAT_DTYPES or len(e.shape) != 2:
            raise GPT2PortError(f"{weights}: tensor {key!r} is not a float matrix ({e.dtype}, shape {e.shape})")
        found.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = (key, e.shape)
    if not found:
        raise GPT2PortError(f"{weights}: holds no LoRA tensors")
    tensors = mmap_tensors(header)
    out = {}
    for (layer, module), parts in sorted(found.items()):
        name = f"blocks.{layer}.{_OURS[module]}"
        if set(parts) != {"A", "B"}:
            have = next(iter(parts.values()))[0]
            raise GPT2PortError(f"{weights}: {have!r} has no lora_{'B' if 'A' in parts else 'A'} beside it")
        (ka, sa), (kb, sb) = parts["A"], parts["B"]
        if sa[0] != sb[1]:
            raise GPT2PortError(f"{weights}: {ka!r} has rank {sa[0]} (shape {sa}) but {kb!r} {sb[1]} (shape {sb})")
        module_name = hf_module(name)
        settings.refuse_unadapted(module_name, layer, ka, weights)
        r = sa[0]
        if r != settings.rank(module_name):
            raise GPT2PortError(f"{weights}: {ka!r} has rank {r} (shape {sa}); {cfg_path} gives {module_name} rank "
                                f"{settings.rank(module_name)} (r, rank_pattern)")
        if config is not None:
            _check_base(weights, config, layer, module, ka, sa, kb, sb)
        a, b = tensors[ka].float(), tensors[kb].float()
        scaling = settings.scaling(module_name, r)
        check_tensors(weights, ka, a, kb, b, scaling)
        out[name] = (a, b, float(scaling))
    if config is None:
        _check_gpt2_shapes(weights, found)
    return out, cfg


def check_tensors(weights, ka: str, a: torch.Tensor, kb: str, b: torch.Tensor, scaling: float) -> None:
    """A and B finite, and scaling * B A within float32 (bounded by rank * max|A| * max|B| * scaling, without
    forming the product): a NaN or an overflow would become the merged weights, or an adapter GGUF, in silence."""
    for key, t in ((ka, a), (kb, b)):
        if not bool(torch.isfinite(t).all()):
            raise GPT2PortError(f"{weights}: tensor {key!r} holds NaN or Inf")
    bound = a.shape[0] * float(a.abs().max()) * float(b.abs().max()) * scaling
    if not bound < torch.finfo(torch.float32).max / 16:
        raise GPT2PortError(f"{weights}: {ka!r} and {kb!r} at scaling {scaling:g}: their product can overflow "
                            f"float32 (up to {bound:.3g})")


def _check_gpt2_shapes(weights, found: dict) -> None:
    """With no base to compare with, the shapes a GPT-2 has: one width C for every module, c_attn (C, 3C), attn's
    c_proj (C, C), c_fc (C, 4C), mlp's c_proj (4C, C), as (in, out)."""
    widths = {}
    for (layer, module), parts in found.items():
        (ka, sa), (_, sb) = parts["A"], parts["B"]
        n_in, n_out = sa[1], sb[0]
        ratio = {"attn.c_attn": (1, 3), "attn.c_proj": (1, 1), "mlp.c_fc": (1, 4), "mlp.c_proj": (4, 1)}[module]
        c = n_in // ratio[0]
        if n_in != c * ratio[0] or n_out != c * ratio[1] or c < 1:
            raise GPT2PortError(f"{weights}: {ka!r} adapts a {n_in} x {n_out} matrix, a shape GPT-2's {module} does "
                                f"not have ({ratio[0]}C inputs, {ratio[1]}C outputs)")
        widths.setdefault(c, ka)
    if len(widths) > 1:
        (c1, k1), (c2, k2) = list(widths.items())[:2]
        raise GPT2PortError(f"{weights}: {k1!r} is of a model of width {c1}, {k2!r} of width {c2}: no GPT-2 has both")


def _check_base(weights, config: GPTConfig, layer, module, ka, sa, kb, sb) -> None:
    """The adapter's shapes against the base's: an adapter of another model is named with both shapes."""
    C, M = config.n_embd, config.mlp_width
    n_in, n_out = {"attn.c_attn": (C, 3 * C), "attn.c_proj": (C, C), "mlp.c_fc": (C, M), "mlp.c_proj": (M, C)}[module]
    if layer >= config.n_layer:
        raise GPT2PortError(f"{weights}: {ka!r} adapts layer {layer}; the base has {config.n_layer} layers "
                            f"(an adapter made for another model)")
    for key, got, want in ((ka, tuple(sa), (sa[0], n_in)), (kb, tuple(sb), (n_out, sb[1]))):
        if got != want:
            raise GPT2PortError(f"{weights}: {key!r} has shape {got}; the base (n_embd {C}) needs {want} (an adapter "
                                f"made for another model)")
