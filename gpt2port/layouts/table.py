"""A layout: one table mapping the canonical tensor set to the names (and transforms) some file or class uses.

A row is (canonical template, layout template, transform); `{}` stands for the layer index. Reading checks that
every key of a file is consumed exactly once or dropped by name, and that every canonical tensor is present;
writing lists the layout's tensors in canonical order. Both directions use the same rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from gpt2port.config import GPTConfig
from gpt2port.errors import GPT2PortError
from gpt2port.layouts import canonical
from gpt2port.layouts.transforms import IDENTITY, Transform

_INDEX = re.compile(r"(?<=\.)\d+(?=\.)")


@dataclass(frozen=True)
class Row:
    canonical: str
    key: str
    transform: Transform = IDENTITY


@dataclass(frozen=True)
class Read:
    """A source key and what it holds: the canonical tensor `target` (or one part of it), through `transform`."""
    key: str
    target: str
    transform: Transform


@dataclass(frozen=True)
class Write:
    key: str
    source: str  # canonical name
    transform: Transform
    shape: tuple[int, ...]


def template(key: str, index: re.Pattern = _INDEX) -> tuple[str, tuple[int, ...]]:
    """'h.7.attn.c_attn.weight' -> ('h.{}.attn.c_attn.weight', (7,)). Only the first number is the layer: later ones
    are part of the name (a Sequential's 'ff.layers.0.weight'). `index`: where a layout writes its layer number
    (between dots by default; TensorFlow's 'model/h7/attn' has it after 'h')."""
    m = index.search(key)
    if m is None:
        return key, ()
    return key[:m.start()] + "{}" + key[m.end():], (int(m.group()),)


@dataclass(frozen=True)
class Layout:
    name: str
    rows: tuple[Row, ...]
    dropped: frozenset[str] = frozenset()  # templates of keys that carry nothing (e.g. causal-mask buffers)
    read_prefixes: tuple[str, ...] = ()  # prefixes a file may put before every key; stripped on read
    write_prefix: str = ""
    index: re.Pattern = _INDEX  # where this layout's keys carry the layer number (see template)
    # The head's key when a file stores it: for a tied model (GPT-2) a copy, accepted on read only if it equals the
    # embedding; for an untied one (tie_word_embeddings False) the head itself, read and written under this key.
    untied_head: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors metadata this layout writes
    # A format that fixes where each tensor lies (llm.c: grouped by kind across layers) orders plan_write's list
    # itself; None lets a conversion write in the order the source's bytes lie.
    order: Callable[[list[Write]], list[Write]] | None = None

    def __post_init__(self):
        by_key: dict[str, list[Row]] = {}
        for row in self.rows:
            by_key.setdefault(row.key, []).append(row)
        object.__setattr__(self, "by_key", by_key)  # a frozen dataclass sets its derived index this way

    def strip(self, key: str) -> str:
        for p in self.read_prefixes:
            if key.startswith(p):
                return key[len(p):]
        return key

    def key_for(self, name: str) -> str:
        """The layout's key for a canonical tensor (its first row's), for messages."""
        tpl, idx = template(name)
        row = next(r for r in self.rows if r.canonical == tpl)
        return row.key.format(*idx)

    def canonical_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The canonical shapes a file's tensors imply (keys this layout does not know are left out), for telling the
        size of the model a file holds."""
        out = {}
        for key, shape in shapes.items():
            tpl, idx = template(self.strip(key), self.index)
            for row in self.by_key.get(tpl, ()):
                if row.transform.exact_shape:
                    out[row.canonical.format(*idx)] = row.transform.canonical_shape(tuple(shape))
        return out

    def explains(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        """Whether every name is in this table (a row, dropped on purpose, or the untied head), and the fused q|k|v
        projection comes out (3 x width, width): the shape tells an (out, in) table from an (in, out) one with the
        same names."""
        for key in shapes:
            bare = self.strip(key)
            tpl, _ = template(bare, self.index)
            if bare != self.untied_head and tpl not in self.by_key and tpl not in self.dropped:
                return False
        canon = self.canonical_shapes(shapes)
        emb, qkv = canon.get(canonical.EMBEDDING), canon.get(canonical.QKV.format(0))
        return emb is not None and len(emb) == 2 and (qkv is None or tuple(qkv) == (3 * emb[1], emb[1]))

    def plan_read(self, keys, config: GPTConfig, where: str) -> tuple[list[Read], list[str], str | None]:
        """Decide the fate of every key of a file: mapped, dropped, or (an untied head) to be checked.

        Returns (reads, dropped keys, head key or None). Raises, naming the keys and `where`, if any key is unknown
        or held twice, or any canonical tensor would be missing.
        """
        reads, dropped, head, unknown, seen = [], [], None, [], {}
        for key in keys:
            bare = self.strip(key)
            if bare == self.untied_head:
                if config.tie_word_embeddings:  # GPT-2's tied head, stored once more: checked equal to the embedding
                    head = key
                else:  # a head of its own
                    seen[(canonical.HEAD, IDENTITY.name)] = key
                    reads.append(Read(key, canonical.HEAD, IDENTITY))
                continue
            tpl, idx = template(bare, self.index)
            if any(i >= config.n_layer for i in idx[:1]):
                unknown.append(key)
            elif tpl in self.dropped:
                dropped.append(key)
            elif tpl in self.by_key:
                for row in self.by_key[tpl]:
                    target = row.canonical.format(*idx)
                    slot = (target, row.transform.name)
                    if slot in seen:
                        raise GPT2PortError(f"{where}: keys {seen[slot]!r} and {key!r} both hold {bare!r}")
                    seen[slot] = key
                    reads.append(Read(key, target, row.transform))
            else:
                unknown.append(key)
        if unknown:
            raise GPT2PortError(f"{where}: unexpected keys: {short_list(unknown)}")
        missing = [key for name in canonical.shapes(config) for key in self._missing(name, seen)]
        if not config.tie_word_embeddings and (canonical.HEAD, IDENTITY.name) not in seen:
            missing.append(self.untied_head or canonical.HEAD)
        if missing:
            raise GPT2PortError(f"{where}: missing keys: {short_list(missing)}")
        return reads, dropped, head

    def _missing(self, name: str, seen: dict) -> list[str]:
        """The layout's keys for canonical tensor `name` that a file lacks: all of its rows' keys are needed (a
        tensor stored as q, k and v parts needs all three)."""
        tpl, idx = template(name)
        rows = [r for r in self.rows if r.canonical == tpl]
        return [r.key.format(*idx) for r in rows if (name, r.transform.name) not in seen]

    def plan_write(self, config: GPTConfig) -> list[Write]:
        """Every tensor this layout stores for a model of `config`, in canonical order."""
        out = []
        for name, shape in canonical.shapes(config).items():
            tpl, idx = template(name)
            for row in self.rows:
                if row.canonical == tpl:
                    out.append(Write(self.write_prefix + row.key.format(*idx), name, row.transform,
                                     row.transform.layout_shape(shape)))
        if not config.tie_word_embeddings:
            if self.untied_head is None:
                raise GPT2PortError(f"the {self.name} layout has no place for a head apart from the token embedding "
                                    f"(this model's head is untied); it cannot be written without changing the model")
            out.append(Write(self.untied_head, canonical.HEAD, IDENTITY, canonical.shapes(config)[canonical.HEAD]))
        return out


def short_list(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")
