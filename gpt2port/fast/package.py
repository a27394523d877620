"""The CPU decode step compiled ahead of time (Settings(compile=True)): the model's forward for one token, exported
by torch.export and compiled by AOTInductor into a package kept in gpt2port's per-machine cache (beside the kernels
of fast.native, under steps/), so that a model shape is compiled once per machine and a later process loads it in
about a second, with no dynamo tracing.

What is exported is `Step`: the forward with the cache's keys and values as the module's buffers (so that export
sees them as the state gpt2port::attend_one writes, not as constants) and the position a (1,) tensor. The package
holds code, not weights (aot_inductor.package_constants_in_so off): the model's tensors and the cache's are handed
to it as they are (user-managed constants), so nothing is copied and a package serves every checkpoint of its shape.
Its name hashes the exported graph (an edit to model.py or to a layer is another graph, so another package), every
tensor's shape and dtype, the thread count (Inductor's code fixes it), this PyTorch, the CPU and gpt2port's kernels.
A later process finds the package without exporting where the model's fingerprint (fast.fingerprint: its code and
shapes, stable across processes) was seen before, and exports the forward to name the package where it was not (an
object with no stable description, a changed source file: seconds at 124M, no compile where the graph is the same).
Either way the loaded step is checked against the forward before it is trusted, and a fingerprint whose package
disagreed is forgotten. Within a process, a loaded package is kept for the model as it is (its modules, their
tensors, attributes and classes' functions, by identity) and handed the next cache, so a later generation neither
exports nor loads again; any change to the model is another export.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import tempfile
import time
import warnings
import weakref
from pathlib import Path

import torch
import torch._inductor  # AOTInductor's entry points (this module is imported only when a step is compiled)

from gpt2port import inputs
from gpt2port.errors import GPT2PortError
from gpt2port.fast import fingerprint, native

ANNOUNCE = "gpt2port: compiling the decode step for this model shape ahead of time, once per machine " \
           "(AOTInductor: ~30-60 s at 124M on 2 cores)"


class Step(torch.nn.Module):
    """GPT.forward for one token (ids (1, 1), pos (1,)) -> logits (1, 1, vocab), over `cache`, whose keys and values
    are this module's buffers."""

    def __init__(self, model, cache):
        super().__init__()
        self.model, self.cache = model, cache
        self.register_buffer("k", cache.k, persistent=False)
        self.register_buffer("v", cache.v, persistent=False)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.k, self.cache.v = self.k, self.v  # while exported: the buffers export tracks (put back by load)
        return self.model(ids, cache=self.cache, pos=pos, logits_to_keep=1)[0]


# this process's loaded packages, by _identity() of the model and cache they served (with the objects that identity
# names by id, kept alive so that no id is reused while it names a package)
_LOADED: dict[tuple, tuple[object, list, str | None]] = {}
# which Bound each loaded package holds the tensors of now (weakly: a finished generation's cache is not kept alive)
_BOUND: dict[int, weakref.ref] = {}


class Bound:
    """A loaded package over one model's and one cache's tensors. Generations of the same model share the package;
    each call hands it this one's tensors first where another generation's were handed it since (two generators
    interleaved each keep their own cache)."""

    def __init__(self, runner, tensors: dict[str, torch.Tensor], key: str | None):
        self.runner, self.tensors, self.key = runner, tensors, key

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        bound = _BOUND.get(id(self.runner))
        if bound is None or bound() is not self:
            self.runner.load_constants(self.tensors, check_full_update=True, user_managed=True)
            _BOUND[id(self.runner)] = weakref.ref(self)
        return self.runner(ids, pos)


def load(model, cache) -> Bound:
    """The compiled step over `model` and `cache`: called with (ids (1, 1) int64, pos (1,) int64), it returns the
    logits (1, 1, vocab) and writes the cache as the forward does. Compiled and stored first where this machine has
    no package for it. Raises what export, the compiler or the loader raise, each meaning: not compiled."""
    step = Step(model, cache)
    held = dict(step.named_parameters(remove_duplicate=False))
    held.update(step.named_buffers(remove_duplicate=False))
    identity, named = _identity(model, cache)
    if identity in _LOADED:  # the same model as it was: only the cache is new
        runner = _LOADED[identity][0]
        return Bound(runner, {n: held[n] for n in runner.get_constant_fqns()}, _LOADED[identity][2])
    key = fingerprint.of(model, cache, _machine())
    path = _found(key)
    if path is None:  # exported, to name the package by the graph the forward is now
        keys, values = cache.k, cache.v
        example = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        try:
            with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the exporter's notes are not for the user
                exported = torch.export.export(step, example, strict=False)
        finally:
            cache.k, cache.v = keys, values
        path = _packaged(exported, _name(exported, held))
        _remember(key, path)
    try:
        # Inductor checks, before loading, that the package's vector ISA is this CPU's by building and loading a
        # probe per ISA in child processes (~1.6 s); the package's name already names this CPU.
        with torch._inductor.config.patch({"cpp.vec_isa_ok": True}):
            runner = torch._inductor.aoti_load_package(str(path))
    except Exception:  # a broken or foreign file: gone, so that the next run compiles it again
        path.unlink(missing_ok=True)
        raise
    names = runner.get_constant_fqns()
    foreign = [n for n in names if n not in held]
    if foreign:
        raise RuntimeError(f"the exported step holds tensors that are not the model's or the cache's: {foreign[:3]}")
    _LOADED[identity] = runner, named, key
    return Bound(runner, {n: held[n] for n in names}, key)


def forget(bound: Bound) -> None:
    """A step that disagreed with the forward: not found again by its model's fingerprint (a later run exports the
    forward to name its package) nor kept in this process."""
    if bound.key is not None:
        (native.cache_dir() / "steps" / f"{bound.key}.key").unlink(missing_ok=True)
    for identity in [i for i, held in _LOADED.items() if held[0] is bound.runner]:
        del _LOADED[identity]


def _found(key: str | None) -> Path | None:
    """The package the fingerprint `key` was last found to name, where it is still there."""
    if key is None:
        return None
    try:
        name = inputs.read_text(native.cache_dir() / "steps" / f"{key}.key", 256, "a step's key").strip()
    except (OSError, GPT2PortError):
        return None
    path = native.cache_dir() / "steps" / f"{name}.pt2"
    return path if name.isalnum() and path.is_file() else None


def _remember(key: str | None, path: Path) -> None:
    if key is None:
        return
    fd, tmp = tempfile.mkstemp(prefix=".key-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(path.stem)
    os.replace(tmp, path.parent / f"{key}.key")


def _identity(model, cache) -> tuple[tuple, list]:
    """(what the exported graph depends on, the objects it names): every module's class and attributes (a tensor
    by its shape, strides and dtype, as its values are handed over anew each time; whatever is hashable by value,
    which for a function is its identity; anything else by id), the functions of every class involved (model.py edited
    and reloaded, or patched, is another function), the cache's class and shape, and the thread count."""
    named: list = []

    def value(v):
        if isinstance(v, torch.Tensor):
            return ("tensor", tuple(v.shape), v.stride(), v.dtype)
        if isinstance(v, (list, set, frozenset)):  # by their elements (a set's in a fixed order)
            items = tuple(value(e) for e in v)
            return (type(v).__name__, tuple(sorted(items, key=repr)) if not isinstance(v, list) else items)
        named.append(v)
        try:  # by value where it has one (a number, a tuple, frozen settings; a function is its identity)
            hash(v)
            return ("value", type(v), v)
        except TypeError:
            return ("id", id(v))

    parts: list = [torch.get_num_threads(), tuple(cache.k.shape), cache.k.dtype]
    classes = {type(cache)}
    for name, m in model.named_modules():
        classes.add(type(m))
        attrs = [(k, value(v)) for k, v in vars(m).items() if k not in ("_parameters", "_buffers", "_modules")
                 and not isinstance(v, dict)]
        tensors = [(k, value(v)) for d in (m._parameters, m._buffers) for k, v in d.items()]
        parts.append((name, type(m), tuple(sorted(attrs, key=str)), tuple(tensors), tuple(m._modules)))
    for cls in sorted(classes, key=lambda c: c.__qualname__):
        for klass in cls.__mro__:
            parts.append((klass, tuple(sorted((k, value(v)) for k, v in vars(klass).items() if callable(v)))))
    return tuple(parts), named


def _name(exported, held: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(exported.graph_module.code.encode())
    h.update(str(exported.graph_signature).encode())
    for name in sorted(held):
        t = held[name]
        h.update(f"\0{name}:{tuple(t.shape)}:{t.stride()}:{t.dtype}".encode())
    for part in _machine():
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:24]


def _machine() -> tuple[str, ...]:
    """What a package depends on besides the graph: this PyTorch, the CPU, the thread count (Inductor's code fixes
    it) and gpt2port's kernels."""
    lib = native.kernels().lib
    return (torch.__version__, str(torch.version.git_version), platform.machine(), native.cpu_identity(),
            str(torch.get_num_threads()), lib._name if lib is not None else "")


def _packaged(exported, name: str) -> Path:
    """The package for `exported` in the cache, compiled there first (under the cache's lock, announced on stderr)
    where it is not."""
    directory = native.cache_dir() / "steps"
    path = directory / f"{name}.pt2"
    if path.is_file():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with native.locked(directory / ".lock"):
        if path.is_file():  # compiled by another process while this one waited
            return path
        print(ANNOUNCE, file=sys.stderr, flush=True)
        start = time.perf_counter()
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".pt2", dir=directory)
        os.close(fd)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch._inductor.aoti_compile_and_package(
                    exported, package_path=tmp, inductor_configs={"aot_inductor.package_constants_in_so": False})
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
        print(f"gpt2port: decode step compiled in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return path
