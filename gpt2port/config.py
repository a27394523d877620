"""GPTConfig: the shape of a GPT-2, the four official presets and their aliases, and the bridge to HF config.json."""

from __future__ import annotations

import dataclasses
import math
import numbers
import reprlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpt2port.activations import TABLE
from gpt2port.errors import GPT2PortError, did_you_mean


# The activations the model implements, by their HF `activation_function` name (activations.py's table): a config is
# valid iff its name is there.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {name: a.fn for name, a in TABLE.items()}


@dataclass
class GPTConfig:
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block; n_embd must divide by it
    n_embd: int = 768  # width of the residual stream
    vocab_size: int = 50257  # GPT-2 BPE: 50,000 merges + 256 byte tokens + <|endoftext|>
    n_positions: int = 1024  # context length = rows of the learned position embedding
    n_inner: int | None = None  # MLP hidden width; None means 4 * n_embd, as in every official GPT-2
    layer_norm_epsilon: float = 1e-5  # GPT-2's LayerNorm eps (PyTorch's default is also 1e-5)
    activation: str = "gelu_new"  # GPT-2 uses the tanh approximation of GELU, not the exact erf form
    scale_attn_weights: bool = True  # divide attention scores by sqrt(head_dim), as GPT-2 does
    dropout: float = 0.0  # for fine-tuning only; pretrained inference is deterministic with 0
    # GPT-2 ties its head to the token embedding; a model fine-tuned with its own head (a user's untied class) is
    # kept as it is: False stores lm_head.weight apart (checkpoint format gpt2port/v2).
    tie_word_embeddings: bool = True

    def __post_init__(self):
        _validate(self)

    @property
    def mlp_width(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def preset(cls, name: str) -> "GPTConfig":
        return cls(**PRESETS[canonical_name(name)])

    @classmethod
    def from_hf_config(cls, hf: dict, source: str = "config.json", keys: dict | None = None) -> "GPTConfig":
        """Build from a transformers GPT2Config dict; refuse settings this model cannot reproduce exactly, and values
        GPTConfig refuses, naming `source` and the key (keys: config.json name -> the name the source uses, for
        sizes read from other files: hparams.json, GGUF metadata, a training checkpoint's model_args)."""
        model_type = hf.get("model_type", "gpt2")
        if model_type != "gpt2":
            raise GPT2PortError(f"{source}: model_type {_shown(model_type)} is not GPT-2")
        for key, ok_value in _HF_SETTINGS_MUST_BE.items():
            if key in hf and hf[key] not in (None, ok_value):
                raise GPT2PortError(f"{source}: {key}={_shown(hf[key])} is not supported ({_HF_SETTING_WHY[key]})")
        activation = hf.get("activation_function", "gelu_new")
        if not isinstance(activation, str) or activation not in ACTIVATIONS:
            raise GPT2PortError(
                f"{source}: activation_function {_shown(activation)} is not supported "
                f"(supported: {', '.join(ACTIVATIONS)})"
            )
        positions = "n_positions" if hf.get("n_positions") is not None or "n_ctx" not in hf else "n_ctx"
        try:
            return cls(
                n_layer=hf["n_layer"],
                n_head=hf["n_head"],
                n_embd=hf["n_embd"],
                vocab_size=hf["vocab_size"],
                n_positions=hf.get(positions) if hf.get(positions) is not None else 1024,
                n_inner=hf.get("n_inner"),
                layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
                activation=activation,
                scale_attn_weights=hf.get("scale_attn_weights", True),
                tie_word_embeddings=hf.get("tie_word_embeddings", True),
            )
        except KeyError as e:
            field = (keys or {}).get(e.args[0], e.args[0])
            raise GPT2PortError(f"{source}: missing required field {field!r}") from None
        except ConfigError as e:
            key = positions if e.field == "n_positions" else e.field
            raise e.named(source, (keys or {}).get(key, key)) from None

    def to_hf_config(self) -> dict:
        """A config.json that transformers.GPT2LMHeadModel loads as this exact model."""
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_embd": self.n_embd,
            "vocab_size": self.vocab_size,
            "n_positions": self.n_positions,
            "n_ctx": self.n_positions,
            "n_inner": self.n_inner,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "activation_function": self.activation,
            "scale_attn_weights": self.scale_attn_weights,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "add_cross_attention": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attn_pdrop": 0.1,
            "embd_pdrop": 0.1,
            "resid_pdrop": 0.1,
            "initializer_range": 0.02,
            "bos_token_id": 50256,
            "eos_token_id": 50256,
        }


class ConfigError(GPT2PortError):
    """A GPTConfig value it cannot hold; `field` names it, so that a reader can name the key as its file spells it."""

    def __init__(self, field: str, value, why: str):
        self.field, self.value, self.why = field, value, why
        super().__init__(f"config: {field}={_shown(value)} {why}")

    def named(self, source, key: str) -> GPT2PortError:
        return GPT2PortError(f"{source}: {key}={_shown(self.value)} {self.why}")


def _shown(value) -> str:
    """A value read from a file, as a message shows it: bounded, however long or deep it is."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = 40
    r.maxlist = r.maxdict = 4
    r.maxlevel = 2
    return r.repr(value)
_SIZES = ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions", "n_inner")  # n_inner may also be None
_SWITCHES = ("scale_attn_weights", "tie_word_embeddings")


def _validate(c: GPTConfig) -> None:
    """Every field a value this model can hold; integers (numpy's included) stored as int, reals as float. A value
    that merely converts (2.5 layers, "12", True) is refused, not truncated: it says the file is not what it seems."""
    for name in _SIZES:
        v = getattr(c, name)
        if v is None and name == "n_inner":
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ConfigError(name, v, "must be a positive integer")
        setattr(c, name, int(v))
    eps = c.layer_norm_epsilon
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps <= 0:
        raise ConfigError("layer_norm_epsilon", eps, "must be a finite number > 0")
    c.layer_norm_epsilon = float(eps)
    p = c.dropout
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 <= p < 1:
        raise ConfigError("dropout", p, "must be a number in [0, 1)")
    c.dropout = float(p)
    for name in _SWITCHES:
        if not isinstance(getattr(c, name), bool):
            raise ConfigError(name, getattr(c, name), "must be true or false")
    if c.n_embd % c.n_head:
        raise ConfigError("n_embd", c.n_embd, f"is not divisible by n_head={c.n_head}")
    if not isinstance(c.activation, str) or c.activation not in ACTIVATIONS:
        raise ConfigError("activation", c.activation, f"is not supported (supported: {', '.join(ACTIVATIONS)})")


# HF GPT2Config switches that change the computation in ways this model does not implement.
_HF_SETTINGS_MUST_BE = {
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
}
_HF_SETTING_WHY = {
    "scale_attn_by_inverse_layer_idx": "per-layer attention scaling is not implemented",
    "add_cross_attention": "cross-attention (encoder-decoder use) is not implemented",
}

PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
}

HUB_REPOS = {name: f"openai-community/{name}" for name in PRESETS}

# Every spelling people use for the four models: parameter counts, OpenAI's original release names, Hub ids.
ALIASES = {
    **{name: name for name in PRESETS},
    **{repo: name for name, repo in HUB_REPOS.items()},
    "124M": "gpt2", "117M": "gpt2", "small": "gpt2",
    "355M": "gpt2-medium", "345M": "gpt2-medium", "medium": "gpt2-medium",
    "774M": "gpt2-large", "762M": "gpt2-large", "large": "gpt2-large",
    "1558M": "gpt2-xl", "1542M": "gpt2-xl", "1.5B": "gpt2-xl", "xl": "gpt2-xl",
}
_ALIASES_FOLDED = {k.lower(): v for k, v in ALIASES.items()}


def canonical_name(name: str) -> str:
    """gpt2 / gpt2-medium / gpt2-large / gpt2-xl for any known alias; a clear error otherwise."""
    found = _ALIASES_FOLDED.get(name.lower())
    if found is None:
        raise GPT2PortError(
            f"unknown model name {name!r}{did_you_mean(name, ALIASES)}; known: {', '.join(PRESETS)} "
            f"(aliases: {', '.join(k for k in ALIASES if k not in PRESETS and '/' not in k)})"
        )
    return found


def is_known_name(name: str) -> bool:
    return name.lower() in _ALIASES_FOLDED

