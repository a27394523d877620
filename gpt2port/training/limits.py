"""The range of every number a fine-tuning run takes, checked once for the command line, the Python call and a saved
run's meta.json alike: a value out of range is refused in one line naming the option (or the file and key).

Floats must be finite: click's float type, like Python's, reads "inf" and "nan", and a NaN compares false with
everything, so a range check written as `x < 0` lets it through. The integer bounds are what the numbers feed:
the seed goes to torch.manual_seed (64 bits, plus the rank); step counts are exact as floats (the learning rate
schedule divides them); AdamW moves each weight by about the learning rate per step, and multiplies it by
1 - lr x weight_decay (above 1, a learning rate only destroys the model; above float32's range it does not even
run); a global batch above 65536 sequences is no fine-tuning batch, and its index arrays and
windows would be allocated whole.
"""

from __future__ import annotations

import math
from typing import Callable

from gpt2port.errors import GPT2PortError

STEPS_MAX = 1 << 53
BATCH_MAX = 1 << 16
SEED_MAX = (1 << 63) - 1
DTYPES = ("auto", "fp32", "bf16")

# name: (kind, lowest, highest, whether the lowest is excluded, whether the highest is excluded); a bound given as a
# name is another setting's value.
RULES: dict[str, tuple] = {
    "steps": (int, 1, STEPS_MAX, False, False),
    "batch_size": (int, 1, BATCH_MAX, False, False),
    "block_size": (int, 1, None, False, False),  # and at most the model's context (finetune checks it)
    "lr": (float, 0.0, 1.0, True, False),
    "min_lr": (float, 0.0, "lr", False, False),
    "warmup": (int, 0, "steps", False, False),
    "weight_decay": (float, 0.0, "1/lr", False, False),
    "clip": (float, 0.0, None, False, False),  # 0: no clipping
    "grad_accum": (int, 1, "batch_size", False, False),
    "eval_every": (int, 0, STEPS_MAX, False, False),  # 0: no evaluation
    "eval_windows": (int, 1, STEPS_MAX, False, False),
    "save_every": (int, 0, STEPS_MAX, False, False),  # 0: saved only when stopped
    "sample_every": (int, 0, STEPS_MAX, False, False),  # 0: no samples
    "seed": (int, 0, SEED_MAX, False, False),
    "dropout": (float, 0.0, 1.0, False, True),
    "val_fraction": (float, 0.0, 1.0, True, True),
    "dtype": (str, DTYPES),
    "checkpoint_activations": (int, -1, STEPS_MAX, False, False),  # -1: every block; at most the model's (recompute)
}


def option(name: str) -> str:
    return "--" + name.replace("_", "-")


def check(values: dict, label: Callable[[str, object], str] | None = None) -> None:
    """Refuse the first value of `values` (a resolved Settings as a dict) that is of the wrong type or out of range.
    label(name, value): how the refusal names it (default: the command-line option and the value given)."""
    label = label or (lambda name, value: f"{option(name)} {value}")
    for name, rule in RULES.items():
        if name not in values:
            continue
        value = values[name]
        why = _why(rule, value, values)
        if why is not None:
            raise GPT2PortError(f"{label(name, value)}: {why}")


def _why(rule: tuple, value, values: dict) -> str | None:
    kind = rule[0]
    if kind is str:
        return None if isinstance(value, str) and value in rule[1] else f"one of {', '.join(rule[1])}"
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        return f"must be {'a number' if kind is float else 'a whole number'}"
    if kind is float and not math.isfinite(value):
        return "must be a finite number"
    _, lo, hi, lo_open, hi_open = rule
    if isinstance(hi, str):
        inverse = hi.startswith("1/")
        bound = values.get(hi[2:] if inverse else hi)
        if inverse and _plain_number(bound) and bound > 0:
            hi, hi_text = 1 / bound, f"1/{option(hi[2:])} ({1 / bound:g})"
        else:
            hi, hi_text = (bound, f"{option(hi)} ({bound})") if _plain_number(bound) else (None, "")
    else:
        hi_text = f"{hi:,}" if isinstance(hi, int) and hi > 1 else str(hi)
    low_ok = value > lo if lo_open else value >= lo
    high_ok = hi is None or (value < hi if hi_open else value <= hi)
    if low_ok and high_ok:
        return None
    if hi is None:
        return f"must be {'greater than' if lo_open else 'at least'} {lo}"
    return (f"must be {'above' if lo_open else 'at least'} {lo} and {'below' if hi_open else 'at most'} "
            f"{hi_text}")


def _plain_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
