"""`gpt2port check FILE.py:FACTORY [CKPT]`: build a user's model from their own file, pour GPT-2 into it, show how
it was read and whether it computes GPT-2 (and if not, which stage differs and why).

The factory is called with a config that answers to the names tutorials use for GPT-2's sizes (vocab_size or
n_vocab, block_size or context_length, n_embd or emb_dim or embedding_dim, ...), as attributes and as dict keys; a
factory with no parameters is just called; one whose single parameter is called name/size/model_type gets the
size name ("gpt2-medium"); one whose parameters are all such names gets each by name.

An error raised in the user's file is theirs: it is reported with where it happened in their code, never as ours.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import sys
import threading
import time
import traceback
from pathlib import Path

from torch import nn

from gpt2port.config import GPTConfig, is_known_name
from gpt2port.errors import GPT2PortError, did_you_mean

# the names tutorials give GPT-2's config fields -> gpt2port's
ALIASES = {
    "n_vocab": "vocab_size", "vocab": "vocab_size", "num_embeddings": "vocab_size",
    "block_size": "n_positions", "n_ctx": "n_positions", "context_length": "n_positions", "ctx": "n_positions",
    "max_seq_len": "n_positions", "seq_len": "n_positions", "max_position_embeddings": "n_positions",
    "context_size": "n_positions", "ctx_len": "n_positions", "max_len": "n_positions", "sequence_len": "n_positions",
    "n_layers": "n_layer", "num_layers": "n_layer", "layers": "n_layer", "num_hidden_layers": "n_layer",
    "depth": "n_layer", "num_blocks": "n_layer",
    "n_heads": "n_head", "num_heads": "n_head", "num_attention_heads": "n_head", "heads": "n_head",
    "emb_dim": "n_embd", "d_model": "n_embd", "hidden_size": "n_embd", "dim": "n_embd", "embed_dim": "n_embd",
    "embedding_dim": "n_embd", "n_embed": "n_embd", "d_embed": "n_embd", "emb_size": "n_embd", "width": "n_embd",
    "drop_rate": "dropout", "dropout_rate": "dropout", "p_drop": "dropout", "attn_pdrop": "dropout",
    "resid_pdrop": "dropout", "embd_pdrop": "dropout", "drop": "dropout",
    "layer_norm_eps": "layer_norm_epsilon", "ln_eps": "layer_norm_epsilon", "eps": "layer_norm_epsilon",
    "norm_eps": "layer_norm_epsilon",
}
DERIVED = {  # sizes tutorials compute from the others
    "head_size": lambda c: c.n_embd // c.n_head, "head_dim": lambda c: c.n_embd // c.n_head,
    "d_head": lambda c: c.n_embd // c.n_head, "d_ff": lambda c: c.mlp_width, "ff_dim": lambda c: c.mlp_width,
    "hidden_dim": lambda c: c.mlp_width, "intermediate_size": lambda c: c.mlp_width,
    "mlp_dim": lambda c: c.mlp_width, "d_hidden": lambda c: c.mlp_width,
}
FLAGS = {"bias": True, "qkv_bias": True, "use_bias": True}  # GPT-2 has every bias


@dataclasses.dataclass
class FactoryConfig(GPTConfig):
    """A GPTConfig that also answers to the tutorials' names, as attributes and as dict keys (cfg["emb_dim"],
    cfg.num_heads, **cfg, cfg.get(...), cfg.keys())."""

    def __getattr__(self, name):
        if name in ALIASES:
            return getattr(self, ALIASES[name])
        if name in DERIVED:
            return DERIVED[name](self)
        if name in FLAGS:
            return FLAGS[name]
        raise AttributeError(name)

    def __setattr__(self, name, value):  # cfg.emb_dim = 768 sets n_embd
        object.__setattr__(self, ALIASES.get(name, name), value)

    def __getitem__(self, key):
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def __setitem__(self, key, value):
        setattr(self, key, value)

    def get(self, key, default=None):
        return getattr(self, key, default)

    def __contains__(self, key):
        return hasattr(self, key)

    def keys(self):
        return [f.name for f in dataclasses.fields(self)] + list(ALIASES) + list(DERIVED) + list(FLAGS)

    def __iter__(self):
        return iter(self.keys())

    def __len__(self):
        return len(self.keys())

    def items(self):
        return [(k, self[k]) for k in self.keys()]

    def values(self):
        return [self[k] for k in self.keys()]

    def copy(self):
        return dataclasses.replace(self)

    def update(self, other=(), **more):
        for k, v in {**dict(other), **more}.items():
            self[k] = v


class UserCodeError(GPT2PortError):
    """An exception raised in the user's own file, with where it happened there."""


def theirs(e: BaseException, root: Path, what: str) -> GPT2PortError | None:
    """`e` as the user's error when it was raised in their code (a frame in a file under `root`, outside gpt2port
    and the installed packages): file:line of the last such frame, and the frames that led there."""
    own = Path(__file__).resolve().parents[1]
    frames = []
    for f in traceback.extract_tb(e.__traceback__):
        path = Path(f.filename).resolve()
        if root in path.parents and own not in path.parents and "site-packages" not in path.parts:
            frames.append(f)
    if not frames:
        return None
    last = frames[-1]
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    chain = " <- ".join(f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in reversed(frames[-4:]))
    return UserCodeError(f"{_short(last.filename)}:{last.lineno}: {type(e).__name__}{': ' + text if text else ''} "
                         f"(raised in your code while {what}; traceback, innermost first: {chain})")


def _short(filename: str) -> str:
    try:
        return str(Path(filename).resolve().relative_to(Path.cwd()))
    except ValueError:
        return filename


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
    if loader is None or loader.loader is None:
        raise GPT2PortError(f"{file}: not a Python file that can be imported")
    module = importlib.util.module_from_spec(loader)
    sys.path.insert(0, str(file.resolve().parent))
    try:
        sys.modules[mod_name] = module
        loader.loader.exec_module(module)
    except SystemExit as e:
        raise GPT2PortError(f"{file}: exits while being imported (SystemExit({e.code!r})"
                            f"{_at(e, file)}); put the code that runs it under `if __name__ == \"__main__\":`") from e
    except Exception as e:
        raise theirs(e, file.resolve().parent, f"importing {file.name}") or \
            GPT2PortError(f"{file}: importing it failed: {type(e).__name__}: {e}") from e
    finally:
        sys.path.pop(0)
    factory = getattr(module, name, None)
    if not callable(factory):
        found = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        raise GPT2PortError(f"{file}: has no function or class {name!r}{did_you_mean(name, found)}")
    return factory


def _at(e: BaseException, file: Path) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).resolve() == file.resolve()]
    return f" at {_short(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""


def build(factory, config: GPTConfig, size_name: str | None) -> nn.Module:
    """Call the factory the way its signature asks; its model (or the first module it returns)."""
    cfg = FactoryConfig(**config.to_dict())
    try:
        params = [p for p in inspect.signature(factory).parameters.values()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = [None]
    if not params:
        args, kwargs = (), {}
    elif len(params) == 1 and params[0] is not None and params[0].name in ("name", "size", "model_type") and size_name:
        args, kwargs = (size_name,), {}
    elif all(p is not None and p.name in cfg for p in params):  # GPT(vocab_size, context_length, d_model, ...)
        args, kwargs = (), {p.name: cfg[p.name] for p in params}
    else:
        args, kwargs = (cfg,), {}
    _fits(factory, args, kwargs)
    out = factory(*args, **kwargs)
    if isinstance(out, (tuple, list)):
        out = next((x for x in out if isinstance(x, nn.Module)), None)
    if not isinstance(out, nn.Module):
        raise GPT2PortError(f"{getattr(factory, '__name__', factory)} returned {type(out).__name__}, not an nn.Module")
    return out


def _fits(factory, args: tuple, kwargs: dict) -> None:
    """Refuse, as the user's error at their def line, a factory whose signature check cannot fill."""
    try:
        inspect.signature(factory).bind(*args, **kwargs)
    except TypeError as e:
        name = getattr(factory, "__name__", str(factory))
        try:
            code = factory.__init__ if inspect.isclass(factory) else factory
            where = f"{_short(inspect.getsourcefile(code))}:{inspect.getsourcelines(code)[1]}: "
        except (TypeError, OSError):
            where = ""
        raise UserCodeError(f"{where}{name}: {e} (check calls the factory with one config, with GPT-2's sizes by "
                            f"their names when every parameter is one, or with nothing; give its other parameters "
                            f"defaults)") from None
    except ValueError:  # no signature to read (a builtin): calling it will tell
        pass


# what load_into's keyword arguments are called on check's command line
FLAG_WORDS = {"drop_biases": "--drop-biases", "crop_positions": "--crop-positions", "tie": "--tie"}


def cli_words(text: str) -> str:
    for arg, flag in FLAG_WORDS.items():
        for said in (f"{arg}=True", arg):
            text = text.replace(f"pass {said}", f"pass {flag}").replace(f"({said})", f"({flag})")
    return text


class Steps:
    """Step lines while check works ("check [3/4] 2.1 s: verifying ..."), on stderr: the table and the verdict, the
    results, go to stdout. A step that speaks for itself (beat=False: verify's progress) aside, a step still running
    after `every` seconds says so again, so that a log never falls silent longer (a load ends proving the class over
    its whole context: minutes at 124M on a busy machine)."""

    def __init__(self, total: int, every: float = 10.0):
        self.total, self.n, self.t0, self.every = total, 0, time.perf_counter(), every
        self.current, self.what, self.beat, self.last = "starting", "", False, self.t0
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.ticker = None

    def __call__(self, what: str, beat: bool = True) -> None:
        with self.lock:
            self.n += 1
            self.current, self.what, self.beat = what[0].lower() + what[1:], what, beat
            self._say(what)
        if self.ticker is None:
            from gpt2port.outfile import start_thread

            self.ticker = threading.Thread(target=self._tick, daemon=True, name="gpt2port-check-steps")
            start_thread(self.ticker, "check")

    def _say(self, what: str) -> None:
        self.last = time.perf_counter()
        sys.stderr.write(f"check [{self.n}/{self.total}] {self.last - self.t0:.1f} s: {what}\n")
        sys.stderr.flush()

    def _tick(self) -> None:
        while not self.stop.wait(min(1.0, self.every / 4)):
            with self.lock:
                if self.beat and time.perf_counter() - self.last >= self.every:
                    self._say(f"{self.what} (still working)")

    def close(self) -> None:
        self.stop.set()


def run_check(spec: str, ckpt: str, reference=None, tokens: int = 64, hf: bool = True, say=print, *,
              drop_biases: bool = False, crop_positions: bool = False, tie: bool | None = None,
              progress: bool = False) -> bool:
    """The whole check, printed through `say`; True when the class computes GPT-2. An exception raised in the
    user's file comes out as their error (UserCodeError), with where it happened there."""
    root = Path(spec.rpartition(":")[0] or ".").resolve().parent
    step = Steps(4)
    try:
        return _run(spec, ckpt, reference, tokens, hf, say, drop_biases, crop_positions, tie, progress, step)
    except GPT2PortError:
        raise
    except SystemExit as e:
        raise GPT2PortError(f"{spec}: your code exited (SystemExit({e.code!r})){_where(e, root)}; check needs the "
                            f"factory to return the model") from e
    except Exception as e:
        mine = theirs(e, root, step.current)
        if mine is None:
            raise
        raise mine from e
    finally:
        step.close()


def _where(e: BaseException, root: Path) -> str:
    mine = theirs(e, root, "")
    return f" at {str(mine).split(': ', 1)[0]}" if mine is not None else ""


def _run(spec, ckpt, reference, tokens, hf, say, drop_biases, crop_positions, tie, progress, step) -> bool:
    from gpt2port.checkpoint import read_manifest
    from gpt2port.verification.reference_canonical import is_gpt2port_checkpoint
    from gpt2port.sources import open_source, source_path
    from gpt2port.userclass.load import LoadRefused, load_into
    from gpt2port.userclass.roles import layout_of
    from gpt2port.userclass.verify import verify_model

    path = source_path(ckpt)
    with open_source(path) as src:
        config = src.config
    step(f"building the model with {spec}")
    model = build(load_factory(spec), config, ckpt if is_known_name(str(ckpt)) else None)
    if not any(True for _ in model.parameters()):
        raise GPT2PortError(f"{spec}: returned {type(model).__name__}, a model with no parameters: there is nothing "
                            f"to load GPT-2 into")
    step(f"loading {path} into {type(model).__name__}")
    try:
        report = load_into(model, path, tie=tie, crop_positions=crop_positions, drop_biases=drop_biases)
    except LoadRefused as e:
        table = str(layout_of(model, config)).splitlines()
        say("\n".join(line for line in table if not line.startswith("cannot hold GPT-2: ")))
        reasons = list(dict.fromkeys(e.reasons))
        many = "s" if len(reasons) > 1 else ""
        raise GPT2PortError(f"{type(model).__name__} {e.what} ({len(reasons)} reason{many}): "
                            + "; ".join(cli_words(r) for r in reasons)) from None
    say(cli_words(str(report)))
    if reference is None:
        recorded = read_manifest(path).get("source", {}).get("path") if is_gpt2port_checkpoint(path) else None
        # verify's reference reads a gpt2port checkpoint's own weights as well as an HF directory: CKPT itself
        reference = recorded if recorded and Path(recorded).exists() else path
    step(f"verifying {type(model).__name__} against {reference}" + (" and transformers" if hf else ""),
         beat=not progress)  # verify's own progress speaks
    verdict = verify_model(model, reference, tokens=tokens, hf=hf, progress=progress)
    step("done")
    say(verdict.to_text())
    return verdict.passed
