"""Users' own GPT classes, one module per tutorial style, to pour GPT-2's weights into.

Each style module has build(vocab_size, block_size, n_layer, n_head, n_embd, **options) -> nn.Module and
logits(model, idx) -> (B, T, vocab) logits for every position (whatever the class's forward returns). The
GPT-2-faithful ones (and the biasless ones, which drop what they cannot hold) also have hand_load(model, canonical):
the loader a learner writes by hand, filling the class from gpt2port's canonical tensors (names and (out, in)
layout of gpt2port.layouts.canonical). That is the independent oracle a generic loader is measured against.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch

from gpt2port.config import GPTConfig

STYLES = ("kader", "gpt_mini", "syds", "opaque", "nanochat", "nanogpt", "mingpt", "llms", "lecture", "anonymous",
          "conv1d_style")


def module(style: str):
    if style not in STYLES:
        raise KeyError(f"no user class style {style!r}")
    return importlib.import_module(f"tests.userclasses.{style}")


@dataclass(frozen=True)
class Case:
    """One class: a style and the options it is built with."""

    style: str
    options: dict = field(default_factory=dict)
    # GPT-2 biases the class has no place for, as per-block canonical names ("attn.qkv.bias", ...)
    lacks: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        opts = ",".join(f"{k}={v!r}" for k, v in sorted(self.options.items()))
        return f"{self.style}({opts})" if opts else self.style

    def build(self, config: GPTConfig, block_size: int | None = None, **override):
        """The class at a GPT-2 config's shape (block_size defaults to the config's positions)."""
        return module(self.style).build(config.vocab_size, block_size or config.n_positions, config.n_layer,
                                        config.n_head, config.n_embd, **{**self.options, **override})

    def logits(self, model, idx):
        return module(self.style).logits(model, idx)

    def hand_load(self, model, canonical: dict) -> None:
        module(self.style).hand_load(model, canonical)


# Every GPT-2 tensor has a place, and the class computes what GPT-2 computes (tanh GELU, eps 1e-5, 1/sqrt(D)).
FAITHFUL = [
    Case("syds"),
    Case("opaque"),  # plus a head bias GPT-2 lacks, which a loader sets to zero
    Case("llms", {"qkv_bias": True}),
    Case("llms", {"fused": True, "qkv_bias": True}),
    Case("mingpt"),
    Case("nanogpt", {"gelu": "tanh"}),
    Case("lecture", {"bias": True, "act": "gelu_tanh"}),
    Case("kader", {"bias": True}),
    Case("anonymous"),
    Case("conv1d_style"),
]
# Holds every tensor, but computes GELU with erf: logits close to GPT-2's, not equal.
NANOGPT_ERF = Case("nanogpt")
# Built without some of GPT-2's biases: a faithful load is impossible; dropping them is a measurable choice.
_ALL_BIASES = ("attn.qkv.bias", "attn.proj.bias", "mlp.fc.bias", "mlp.proj.bias")
BIASLESS = [
    Case("kader", lacks=_ALL_BIASES),
    Case("gpt_mini", lacks=("attn.qkv.bias", "attn.proj.bias")),
    Case("llms", lacks=("attn.qkv.bias",)),
    Case("lecture", {"bias": False, "act": "gelu_tanh"}, lacks=("attn.qkv.bias",)),
]
NANOCHAT = Case("nanochat")


def amplify_mlp(ckpt, out, factor: float = 10.0):
    """A copy of a checkpoint with every MLP input weight scaled up. Random-init weights keep GELU's inputs so
    close to zero that the erf and tanh forms agree to ~1e-6; scaled, they differ by ~1e-4 in the logits, which
    is how a real GPT-2 exposes an erf GELU."""
    from gpt2port import GPT

    model = GPT.from_pretrained(ckpt)
    with torch.no_grad():
        for blk in model.blocks:
            blk.mlp.fc.weight.mul_(factor)
    return model.save_pretrained(out)
