"""A model's config from its tensors' canonical shapes, and the check that a config.json describes those tensors.

Works on canonical shapes (Layout.canonical_shapes), so every layout gets the same inference and the same messages.
"""

from __future__ import annotations

from pathlib import Path

from gpt2port.config import PRESETS, GPTConfig
from gpt2port.errors import GPT2PortError
from gpt2port.layouts import canonical

_WORDS = {"n_layer": "{} layers", "n_embd": "width {}", "vocab_size": "vocab_size {}",
          "n_positions": "n_positions {}", "mlp_width": "MLP width {}"}


def layers_held(shapes: dict[str, tuple[int, ...]], where) -> int | None:
    """How many blocks the tensors hold (0 ... N-1), or None if they hold no blocks at all."""
    seen = {i for name in shapes if (i := canonical.layer_of(name)) is not None}
    if not seen:
        return None
    n = max(seen) + 1
    if len(seen) != n:
        gap = min(set(range(n)) - seen)
        raise GPT2PortError(f"{where}: the weights hold layers up to {n - 1} but nothing for layer {gap}")
    return n


def _held(shapes: dict[str, tuple[int, ...]], where) -> dict[str, int | None]:
    held = {"n_layer": layers_held(shapes, where)}
    wte, wpe = shapes.get(canonical.EMBEDDING), shapes.get(canonical.POSITIONS)
    fc = shapes.get(canonical.MLP_IN.format(0))
    if wte is not None and len(wte) == 2:
        held["vocab_size"], held["n_embd"] = wte
    if wpe is not None and len(wpe) == 2:
        held["n_positions"] = wpe[0]
    if fc is not None and len(fc) == 2:
        held["mlp_width"] = fc[0]
    return held


def check_config_matches_weights(config: GPTConfig, shapes: dict[str, tuple[int, ...]], config_path: Path) -> None:
    """config.json and the tensors must describe the same model; name every number that disagrees. Runs before
    anything sizes itself by the config: a config.json copied from another size (or a hostile one saying 10**12
    layers) fails here in words, not later as 300 "missing keys" or an out-of-memory."""
    held = _held(shapes, Path(config_path).parent)
    said = {"n_layer": config.n_layer, "n_embd": config.n_embd, "vocab_size": config.vocab_size,
            "n_positions": config.n_positions, "mlp_width": config.mlp_width}
    differ = [k for k, v in held.items() if v is not None and v != said[k]]
    if not differ:
        return

    def describe(facts: dict) -> str:
        text = ", ".join(_WORDS[k].format(facts[k]) for k in differ)
        size = _preset_name(facts.get("n_layer"), facts.get("n_embd"))
        return text + (f" ({size})" if size else "")

    raise GPT2PortError(f"{config_path} says {describe(said)}; the weights hold {describe(held)}")


def _preset_name(n_layer, n_embd) -> str | None:
    return next((name for name, p in PRESETS.items() if p["n_layer"] == n_layer and p["n_embd"] == n_embd), None)


def infer_config(shapes: dict[str, tuple[int, ...]], where) -> GPTConfig:
    """A config from canonical shapes alone, for weights without a config. n_head is not visible in any shape, so
    only the four official sizes can be recognised; anything else needs its config.json."""
    held = _held(shapes, where)
    if None in (held["n_layer"], held.get("n_embd"), held.get("n_positions"), held.get("mlp_width")):
        raise GPT2PortError(f"{where}: no config.json beside the weights, and they do not look like GPT-2 "
                            f"(no token/position embeddings or blocks)")
    n_layer, n_embd = held["n_layer"], held["n_embd"]
    preset = _preset_name(n_layer, n_embd)
    if preset is None:
        raise GPT2PortError(f"{where}: no config.json beside the weights, and {n_layer} layers x {n_embd} wide is not "
                            f"an official GPT-2 size, so n_head cannot be known; put its config.json beside it")
    return GPTConfig(**PRESETS[preset], vocab_size=held["vocab_size"], n_positions=held["n_positions"],
                     n_inner=None if held["mlp_width"] == 4 * n_embd else held["mlp_width"])
