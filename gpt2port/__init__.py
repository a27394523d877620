"""gpt2port: GPT-2 checkpoints in a clean from-scratch PyTorch model, with proof of parity.

One function per command, importable from here (the CLI calls the same ones):

    gpt2port.download(name, revision=None, out=None, dtype=None, force=False, verify=False)   # Hub -> checkpoint
    gpt2port.convert(src, out, dtype=None, force=False, to="gpt2port")                       # local files -> checkpoint
    gpt2port.export(ckpt, out, to="gpt2port" | "hf", dtype=None, force=False)               # checkpoint -> elsewhere
    gpt2port.verify(ckpt, reference=None, dtype=None, tokens=None, hf=True)                 # -> report.passed
    gpt2port.save(model, out, dtype=None, force=False)                                     # in memory -> checkpoint
    gpt2port.finetune(ckpt, data, out, gpt2port.FinetuneSettings(steps=...), resume=False)   # text -> tuned checkpoint

Your own GPT class (gpt2port.userclass):

    gpt2port.load_into(model, src, tie=None, crop_positions=False, drop_biases=False)       # GPT-2 -> your class
    gpt2port.layout_of(model)                                                               # how it is read
    gpt2port.verify_model(model, reference)                                                 # does it compute GPT-2?
    gpt2port.save_from(model, out)                                                          # your class -> checkpoint
"""

from __future__ import annotations

import importlib

from gpt2port.version import __version__

# Each public name and the module that defines it. They load on first use (PEP 562), so that `import gpt2port`,
# and with it the command line's `--help`, pays for torch only when something here is actually used.
_EXPORTS = {
    "GPT": ("gpt2port.model", "GPT"),
    "KVCache": ("gpt2port.model", "KVCache"),
    "PastKV": ("gpt2port.model", "PastKV"),
    "GPTConfig": ("gpt2port.config", "GPTConfig"),
    "GPT2PortError": ("gpt2port.errors", "GPT2PortError"),
    "FinetuneSettings": ("gpt2port.training.finetune", "Settings"),
    "convert": ("gpt2port.conversion", "convert"),
    "export": ("gpt2port.conversion", "export"),
    "download": ("gpt2port.hub", "download"),
    "finetune": ("gpt2port.training.finetune", "finetune"),
    "init_empty": ("gpt2port.userclass", "init_empty"),
    "layout_of": ("gpt2port.userclass", "layout_of"),
    "load_into": ("gpt2port.userclass", "load_into"),
    "save_from": ("gpt2port.userclass", "save_from"),
    "load_tokenizer": ("gpt2port.checkpoint", "load_tokenizer"),
    "save": ("gpt2port.checkpoint", "save"),
    "verify": ("gpt2port.verification", "run_verify"),
    "verify_model": ("gpt2port.userclass", "verify_model"),
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'gpt2port' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})

