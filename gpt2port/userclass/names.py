"""The words people name GPT-2's parts with, as one table: what a parameter's or module's name can tell about its
role. Names are only ever a first guess: shapes decide what a tensor can be, the order modules run in decides
between equals, and where both are silent the candidates are run against gpt2port's own GPT (settle.py)."""

from __future__ import annotations

import re

# role -> the name tokens that say it (compared case-insensitively, after splitting on '.', '_' and digits)
ROLE_WORDS: dict[str, frozenset[str]] = {
    "q": frozenset({"q", "query", "queries", "wq", "toq", "qproj", "wquery"}),
    "k": frozenset({"k", "key", "keys", "wk", "tok", "kproj", "wkey"}),
    "v": frozenset({"v", "value", "values", "wv", "tov", "vproj", "wvalue"}),
    "proj": frozenset({"proj", "cproj", "outproj", "oproj", "out", "wo", "o", "dense", "output", "projection",
                       "resid", "toout"}),
}
NORM_WEIGHT = frozenset({"weight", "scale", "gamma", "g", "w", "alpha", "gain"})
NORM_BIAS = frozenset({"bias", "shift", "beta", "b", "offset"})
# tokens that name a tensor's kind, not its role: "W_query" and "b_query" are the query's weight and bias
_KIND = frozenset({"w", "weight", "weights", "b", "bias", "biases"})
# name tokens that say a table holds positions, not tokens (a class for characters has more positions than tokens)
POSITION_WORDS = frozenset({"pos", "position", "positions", "positional", "wpe", "posemb"})
# attributes where attention modules keep their head count
HEAD_COUNT_ATTRS = ("n_head", "num_heads", "n_heads", "nh", "num_attention_heads", "head_count")

_SPLIT = re.compile(r"[._\d]+")


def tokens(name: str) -> list[str]:
    return [t for t in _SPLIT.split(name.lower()) if t]


def stem(local: str) -> str:
    """A parameter's local name without the words for weight/bias: 'W_query' and 'b_query' -> 'query'."""
    kept = [t for t in tokens(local) if t not in _KIND]
    return "_".join(kept)


def role_of(*names: str) -> str | None:
    """The attention role ('q', 'k', 'v', 'proj') the last name that says one says, or None. Both the joined form
    ('q_proj' -> 'qproj') and single tokens are tried, joined first (so 'out_proj' is proj, 'q_proj' is q)."""
    for name in reversed(names):
        toks = [t for t in tokens(name) if t not in _KIND]
        if not toks:
            continue
        for candidate in ("".join(toks), toks[-1], toks[0]):
            hits = [role for role, words in ROLE_WORDS.items() if candidate in words]
            if len(hits) == 1:
                return hits[0]
    return None


def norm_role(local: str) -> str | None:
    toks = tokens(local)
    if not toks:
        return None
    if toks[-1] in NORM_WEIGHT:
        return "weight"
    if toks[-1] in NORM_BIAS:
        return "bias"
    return None


def says_position(name: str) -> bool:
    toks = tokens(name)
    return any(t in POSITION_WORDS for t in toks) or "".join(toks) in POSITION_WORDS
