"""`gpt2port check FILE.py:FACTORY [CKPT]`: build a user's model from their own file, pour GPT-2 into it, show how
it was read and whether it computes GPT-2 (and if not, which stage differs and why).

The factory is called with a config that answers to the names tutorials use for GPT-2's sizes (vocab_size or
n_vocab, block_size or context_length, n_embd or emb_dim or d_model, ...), as attributes and as dict keys; a
factory with no parameters is just called; one whose single parameter is called name/size/model_type gets the
size name ("gpt2-medium").
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import sys
from pathlib import Path

from torch import nn

from gpt2port.config import GPTConfig, is_known_name
from gpt2port.errors import GPT2PortError

# the names tutorials give GPT-2's config fields -> gpt2port's
ALIASES = {
    "n_vocab": "vocab_size", "vocab": "vocab_size",
    "block_size": "n_positions", "n_ctx": "n_positions", "context_length": "n_positions",
    "max_seq_len": "n_positions", "seq_len": "n_positions", "max_position_embeddings": "n_positions",
    "n_layers": "n_layer", "num_layers": "n_layer", "layers": "n_layer", "num_hidden_layers": "n_layer",
    "n_heads": "n_head", "num_heads": "n_head", "num_attention_heads": "n_head",
    "emb_dim": "n_embd", "d_model": "n_embd", "hidden_size": "n_embd", "dim": "n_embd", "embed_dim": "n_embd",
    "drop_rate": "dropout", "dropout_rate": "dropout", "p_drop": "dropout",
}
FLAGS = {"bias": True, "qkv_bias": True, "use_bias": True}  # GPT-2 has every bias


@dataclasses.dataclass
class FactoryConfig(GPTConfig):
    """A GPTConfig that also answers to the tutorials' names, as attributes and as dict keys."""

    def __getattr__(self, name):
        if name in ALIASES:
            return getattr(self, ALIASES[name])
        if name in FLAGS:
            return FLAGS[name]
        raise AttributeError(name)

    def __getitem__(self, key):
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def get(self, key, default=None):
        return getattr(self, key, default)

    def __contains__(self, key):
        return hasattr(self, key)


def load_factory(spec: str):
    """'path/to/model.py:make_model' -> the callable (the file imported as a module, its folder on sys.path)."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise GPT2PortError(f"{spec}: expected FILE.py:FACTORY (a function or class in that file)")
    file = Path(path)
    if not file.is_file():
        raise GPT2PortError(f"{file}: no such file")
    mod_name = f"_gpt2port_check_{file.stem}"
    loader = importlib.util.spec_from_file_location(mod_name, file)
    module = importlib.util.module_from_spec(loader)
    sys.path.insert(0, str(file.resolve().parent))
    try:
        sys.modules[mod_name] = module
        loader.loader.exec_module(module)
    except Exception as e:
        raise GPT2PortError(f"{file}: importing it failed: {type(e).__name__}: {e}") from e
    finally:
        sys.path.pop(0)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise GPT2PortError(f"{file}: has no function or class {name!r}")
    return factory


def build(factory, config: GPTConfig, size_name: str | None) -> nn.Module:
    """Call the factory the way its signature asks; its model (or the first module it returns)."""
    try:
        params = [p for p in inspect.signature(factory).parameters.values()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = [None]
    if not params:
        out = factory()
    elif len(params) == 1 and params[0] is not None and params[0].name in ("name", "size", "model_type") and size_name:
        out = factory(size_name)
    else:
        out = factory(FactoryConfig(**config.to_dict()))
    if isinstance(out, (tuple, list)):
        out = next((x for x in out if isinstance(x, nn.Module)), None)
    if not isinstance(out, nn.Module):
        raise GPT2PortError(f"{getattr(factory, '__name__', factory)} returned {type(out).__name__}, not an nn.Module")
    return out


def run_check(spec: str, ckpt: str, reference=None, tokens: int = 64, hf: bool = True, say=print) -> bool:
    """The whole check, printed through `say`; True when the class computes GPT-2."""
    from gpt2port.checkpoint import is_checkpoint, read_manifest
    from gpt2port.sources import open_source, source_path
    from gpt2port.userclass.load import LoadRefused, load_into
    from gpt2port.userclass.roles import layout_of
    from gpt2port.verification.run import verify_model

    path = source_path(ckpt)
    with open_source(path) as src:
        config = src.config
    model = build(load_factory(spec), config, ckpt if is_known_name(str(ckpt)) else None)
    try:
        report = load_into(model, path)
    except LoadRefused as e:
        say(str(layout_of(model, config)))
        say(str(e))
        return False
    say(str(report))
    if reference is None:
        if is_checkpoint(path):
            reference = read_manifest(path).get("source", {}).get("path")
            if not reference or not Path(reference).exists():
                raise GPT2PortError(f"{path}: its source (the reference verify compares against) is not recorded or "
                                    f"gone; pass --reference with the Hugging Face directory it came from")
        else:
            reference = path
    verdict = verify_model(model, reference, tokens=tokens, hf=hf)
    say(verdict.to_text())
    return verdict.passed
