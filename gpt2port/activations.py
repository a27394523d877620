"""The MLP activations gpt2port knows: one table, by the name transformers' GPT-2 config gives each
(`activation_function`), with what model.py computes for it, how messages name it, and which export targets can
express it. Read by config (the names a config may hold), conversion (which targets an activation can go to),
load_into and save_from (what a class's measured activation is called, and recorded as); verify's float64
reference keeps its own formulas, on purpose, under these names.

GPT-2's own is the tanh approximation ("gelu_new"): the exact-erf GELU differs by up to ~1e-3 and breaks logit
parity. The others appear in fine-tuned or re-implemented checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


@dataclass(frozen=True)
class Activation:
    name: str  # transformers' activation_function name
    fn: Callable[[torch.Tensor], torch.Tensor]  # what model.py's MLP computes
    words: str  # how messages name it
    tanh_gelu: bool = False  # GPT-2's own: every target expresses it, also those whose files cannot name it
    same_as: str | None = None  # another name for the same function (the first row of its kind)


_ROWS = (
    Activation("gelu_new", _gelu_tanh, "the tanh-approximated GELU (GPT-2's)", tanh_gelu=True),
    Activation("gelu_pytorch_tanh", _gelu_tanh, "the tanh-approximated GELU (GPT-2's)", True, "gelu_new"),
    Activation("gelu_fast", _gelu_tanh, "the tanh-approximated GELU (GPT-2's)", True, "gelu_new"),
    Activation("gelu", F.gelu, "the exact (erf) GELU"),
    Activation("relu", F.relu, "ReLU"),
    Activation("silu", F.silu, "SiLU"),
    Activation("swish", F.silu, "SiLU", same_as="silu"),
)
TABLE: dict[str, Activation] = {a.name: a for a in _ROWS}
GPT2 = "gelu_new"
DISTINCT = [a.name for a in _ROWS if a.same_as is None]  # one name per function, GPT-2's first


def expressible(name: str, target) -> bool:
    """Whether an export target (targets.Target) can hold a model with this activation: a target whose files
    cannot name the activation (their readers always compute GPT-2's tanh GELU) holds only that one."""
    return TABLE[name].tanh_gelu or not target.tanh_gelu


def words(name: str) -> str:
    return TABLE[name].words
