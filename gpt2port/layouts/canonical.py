"""The canonical GPT-2 tensor set: every tensor a GPT-2 has, once, with its shape, in nn.Linear (out, in) layout.

Canonical names are gpt2port's own parameter names (so gpt2port's layout is the identity table); every other layout
is a table over these. GPT-2's head is tied to the token embedding: one tensor, stored once, as tok_emb.weight; a
model with its own head (tie_word_embeddings False) has HEAD as one more tensor, last.
"""

from __future__ import annotations

import re

from gpt2port.config import GPTConfig

EMBEDDING = "tok_emb.weight"
POSITIONS = "pos_emb.weight"
HEAD = "lm_head.weight"  # the head: stored only when untied (tie_word_embeddings False), after everything else
MLP_IN = "blocks.{}.mlp.fc.weight"  # its rows are the MLP width
QKV = "blocks.{}.attn.qkv.weight"

# (name, shape) per kind of tensor; `{}` is the layer index. C width, F MLP width, V vocabulary, P positions.
_TOP_BEFORE = [(EMBEDDING, "V C"), (POSITIONS, "P C")]
_PER_BLOCK = [
    ("blocks.{}.ln1.weight", "C"), ("blocks.{}.ln1.bias", "C"),
    (QKV, "3C C"), ("blocks.{}.attn.qkv.bias", "3C"),  # q, k, v stacked in that order
    ("blocks.{}.attn.proj.weight", "C C"), ("blocks.{}.attn.proj.bias", "C"),
    ("blocks.{}.ln2.weight", "C"), ("blocks.{}.ln2.bias", "C"),
    (MLP_IN, "F C"), ("blocks.{}.mlp.fc.bias", "F"),
    ("blocks.{}.mlp.proj.weight", "C F"), ("blocks.{}.mlp.proj.bias", "C"),
]
_TOP_AFTER = [("final_norm.weight", "C"), ("final_norm.bias", "C")]
TEMPLATES = [name for name, _ in _TOP_BEFORE + _PER_BLOCK + _TOP_AFTER]

_LAYER = re.compile(r"^blocks\.(\d+)\.")


def _dims(config: GPTConfig) -> dict[str, int]:
    C = config.n_embd
    return {"C": C, "3C": 3 * C, "F": config.mlp_width, "V": config.vocab_size, "P": config.n_positions}


def shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of a model of this config, in storage order, with its shape."""
    dims = _dims(config)

    def shape(spec: str) -> tuple[int, ...]:
        return tuple(dims[d] for d in spec.split())

    out = {name: shape(spec) for name, spec in _TOP_BEFORE}
    for i in range(config.n_layer):
        out.update({name.format(i): shape(spec) for name, spec in _PER_BLOCK})
    out.update({name: shape(spec) for name, spec in _TOP_AFTER})
    if not config.tie_word_embeddings:
        out[HEAD] = shape("V C")
    return out


def counts(config: GPTConfig) -> tuple[int, int]:
    """(how many tensors, how many parameters) shapes(config) holds, without building it: what a size read from a
    file is checked against (the weights' header, the file's bytes) before anything proportional to it is made."""
    dims = _dims(config)

    def numel(spec: str) -> int:
        n = 1
        for d in spec.split():
            n *= dims[d]
        return n

    top = _TOP_BEFORE + _TOP_AFTER + ([(HEAD, "V C")] if not config.tie_word_embeddings else [])
    return (len(top) + config.n_layer * len(_PER_BLOCK),
            sum(numel(s) for _, s in top) + config.n_layer * sum(numel(s) for _, s in _PER_BLOCK))


def layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None
