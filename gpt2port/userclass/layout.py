"""A user's class as a layout: which GPT-2 tensor (and which part of it, through which transform) each of its
parameters holds, and the modules that compute each stage. Printed, it is the table a person reads."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpt2port.config import GPTConfig
from gpt2port.layouts.transforms import IDENTITY, Transform


class CropRows(Transform):
    """The class keeps the first `rows` rows (a context shorter than the checkpoint's, on request)."""

    def __init__(self, rows: int):
        self.rows = rows
        self.name = f"first {rows} rows"

    def to_layout(self, t):
        return t[: self.rows]

    def layout_shape(self, canonical_shape):
        return (self.rows, *canonical_shape[1:])

    def canonical_shape(self, layout_shape):
        return tuple(layout_shape)


class Note(str):
    """A note about what loading does, said in the past tense (a load report) and, as `future`, in the future
    tense (layout_of, before anything is loaded)."""

    future: str

    def __new__(cls, past: str, future: str):
        note = super().__new__(cls, past)
        note.future = future
        return note


@dataclass(frozen=True)
class Assignment:
    param: str  # the user's full parameter name
    target: str | None  # canonical GPT-2 tensor; None: GPT-2 has no such tensor, the parameter is set to zero
    transform: Transform = IDENTITY
    note: str = ""  # what a person should know: "copy of the token embedding", "set to zero"


@dataclass
class Modules:
    """Where each stage of GPT-2 lives in the class (dotted module names, relative to the block for the per-block
    ones), for hooks. None where the class computes that stage inline, without a module of its own."""
    blocks: str = ""
    attn: str | None = None
    mlp: str | None = None
    attn_out: str | None = None  # the attention's and the MLP's last projection, when each is a module of its own
    mlp_out: str | None = None
    ln1: str | None = None
    ln2: str | None = None
    final_norm: str | None = None
    head: str | None = None

    def block(self, i: int) -> str:
        return f"{self.blocks}.{i}" if self.blocks else str(i)


@dataclass
class UserLayout:
    model_name: str  # the class's name
    config: GPTConfig  # the GPT-2 the class is shaped as
    assignments: list[Assignment] = field(default_factory=list)
    modules: Modules = field(default_factory=Modules)
    tied: bool = True  # the head is the token embedding's Parameter (or computed from it)
    head_param: str | None = None  # an untied head's parameter
    decided: list[str] = field(default_factory=list)  # how each ambiguity was settled, for the report
    notes: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)  # why it cannot hold GPT-2 (refusals), one line each
    missing_biases: list[str] = field(default_factory=list)  # modules without the bias GPT-2 has
    missing_bias_targets: set[str] = field(default_factory=set)  # GPT-2's biases they would hold ('{}': layer)
    unknown: list[str] = field(default_factory=list)  # config fields neither shapes nor attributes told ("n_head")
    before_load: bool = False  # read by layout_of: notes say what loading will do
    unsettled: str | None = None  # settle.py: no reading computes GPT-2; this one is the closest

    def __str__(self) -> str:
        return self.table()

    def table(self) -> str:
        """Block 0's rows stand for every block: block indices are shown as {i}."""
        rows, seen = [], set()
        block = re.compile(rf"^{re.escape(self.modules.blocks)}\.(\d+)\.") if self.modules.blocks else None
        for a in self.assignments:
            param, target = a.param, a.target or ("(none: to be set to zero)" if self.before_load else
                                                  "(none: set to zero)")
            if block is not None and block.match(param):
                param = block.sub(f"{self.modules.blocks}.{{i}}.", param)
                target = re.sub(r"^blocks\.\d+\.", "blocks.{i}.", target)
            if param in seen:
                continue
            seen.add(param)
            what = a.transform.name if a.transform is not IDENTITY else "as is"
            rows.append((param, target, what + (f"; {a.note}" if a.note else "")))
        if self.tied:
            rows.append((self.modules.head or "(head)", "tok_emb.weight", "tied: the token embedding's Parameter"))
        w0 = max((len(r[0]) for r in rows), default=10)
        w1 = max((len(r[1]) for r in rows), default=10)
        n_head = "?" if "n_head" in self.unknown else self.config.n_head
        head = f"{self.model_name} as GPT-2 (n_layer={self.config.n_layer}, n_head={n_head}, " \
               f"n_embd={self.config.n_embd}, vocab_size={self.config.vocab_size}, " \
               f"n_positions={self.config.n_positions})"
        lines = [head, f"{'parameter'.ljust(w0)}  {'GPT-2 tensor'.ljust(w1)}  how"]
        lines += [f"{p.ljust(w0)}  {t.ljust(w1)}  {h}" for p, t, h in rows]
        lines += [f"decided: {d}" for d in self.decided]
        lines += [f"note: {n.future if self.before_load and isinstance(n, Note) else n}" for n in self.notes]
        lines += [f"cannot hold GPT-2: {r}" for r in self.reasons]
        return "\n".join(lines)
