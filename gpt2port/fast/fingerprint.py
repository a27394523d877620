"""A name for what a model's exported step would be, found without exporting it: the code the forward can run (every
module's class and the functions it reaches, by their bytecode and by the source files that define them), every
attribute's value and every tensor's shape, stride and dtype. It is stable across processes, so that a later process
finds the package compiled for the same code and shapes (fast.package) without the seconds export takes.

It is a shortcut, never the proof: where anything the forward may read has no value that is stable across processes
(an object known only by its identity), there is no name and the step is exported; a package found by this name is
checked against the forward as it is (fast.graph.Compiled) like any other, and forgotten where it disagrees.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import sys
import types
from pathlib import PurePath

import torch

from gpt2port import inputs
from gpt2port.errors import GPT2PortError

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
          torch.memory_format)
_SOURCE_LIMIT = 64 << 20  # a module's source file, read whole to be hashed

# a class's attributes that are Python's bookkeeping (a dataclass's fields are described by its instances' values)
_SKIPPED = ("_abc_impl", "__dict__", "__weakref__", "__doc__", "__module__", "__qualname__", "__dataclass_fields__",
            "__dataclass_params__", "__match_args__", "__annotations__")


class Unstable(Exception):
    """A value with no description that holds across processes."""


def of(model: torch.nn.Module, cache, extra: tuple = ()) -> str | None:
    """The name of `model`'s step over `cache` (with `extra`: what else the package depends on), or None where
    something it reads has no stable description."""
    walk = _Walk()
    try:
        # the cache by its class and tensors (its other attributes are the state of one generation)
        parts = [walk.value(extra), walk.klass(type(cache)), walk.value(cache.k), walk.value(cache.v)]
        for name, m in model.named_modules():
            own = {k: v for k, v in vars(m).items() if k not in ("_parameters", "_buffers", "_modules")}
            parts.append((name, walk.klass(type(m)), walk.value(own), walk.value(dict(m._parameters)),
                          walk.value(dict(m._buffers)), tuple(m._modules)))
        parts.append(tuple(_file_digest(f) for f in sorted(walk.files)))
    except Unstable:
        return None
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


class _Walk:
    def __init__(self):
        self.files: set[str] = set()  # the source files of the code reached (an edit there is another name)
        self.seen: dict[int, object] = {}  # functions and classes described so far, by id (recursion ends there)

    def value(self, v):
        if isinstance(v, _PLAIN):
            return (type(v).__name__, repr(v))
        if isinstance(v, torch.Tensor):
            return ("tensor", tuple(v.shape), v.stride(), v.dtype, v.device.type)
        if isinstance(v, (tuple, list)):
            return (type(v).__name__, tuple(self.value(e) for e in v))
        if isinstance(v, (set, frozenset)):
            return (type(v).__name__, tuple(sorted((self.value(e) for e in v), key=repr)))
        if isinstance(v, dict):
            return ("dict", tuple(sorted(((repr(k), self.value(e)) for k, e in v.items()), key=lambda p: p[0])))
        if isinstance(v, enum.Enum):
            return ("enum", self.klass(type(v)), v.name)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return ("dataclass", self.klass(type(v)),
                    tuple((f.name, self.value(getattr(v, f.name))) for f in dataclasses.fields(v)))
        if isinstance(v, types.FunctionType):
            return self.function(v)
        if isinstance(v, PurePath):
            return ("path", str(v))
        if isinstance(v, functools.partial):
            return ("partial", self.value(v.func), self.value(v.args), self.value(v.keywords))
        if isinstance(v, type):
            return self.klass(v)
        if isinstance(v, types.ModuleType):
            self._file_of(v)
            return ("module", v.__name__)
        if isinstance(v, (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)):
            return ("builtin", getattr(v, "__module__", None), v.__qualname__)
        if type(v).__module__ == "torch._ops":  # an operator (torch.ops.gpt2port.attend_one): by its name
            return ("operator", str(v))
        if hasattr(v, "cache_info") and isinstance(getattr(v, "__wrapped__", None), types.FunctionType):
            return ("cached", self.function(v.__wrapped__))  # functools.lru_cache and cache
        if isinstance(v, types.MethodType):  # a bound method: of a library's object by its class (torch.no_grad())
            owner = v.__self__
            bound = self.klass(type(owner)) if _library(type(owner).__module__) else self.value(owner)
            return ("method", bound, self.value(v.__func__))
        if isinstance(v, (staticmethod, classmethod)):
            return (type(v).__name__, self.value(v.__func__))
        if isinstance(v, property):
            return ("property", self.value(v.fget), self.value(v.fset))
        raise Unstable(type(v).__qualname__)

    def function(self, fn: types.FunctionType):
        if _library(fn.__module__) or id(fn) in self.seen:
            return ("function", fn.__module__, fn.__qualname__)
        self.seen[id(fn)] = fn
        self._file_of(fn)
        cells = tuple(self.value(c.cell_contents) for c in fn.__closure__ or ())
        reached = tuple((n, self.value(fn.__globals__[n])) for n in sorted(_names(fn.__code__))
                        if n in fn.__globals__)
        return ("function", fn.__module__, fn.__qualname__, _code(fn.__code__), self.value(fn.__defaults__),
                self.value(fn.__kwdefaults__), cells, reached)

    def klass(self, cls: type):
        if _library(cls.__module__) or id(cls) in self.seen:
            return ("class", cls.__module__, cls.__qualname__)
        self.seen[id(cls)] = cls
        self._file_of(cls)
        own = tuple((k, self.value(v)) for k, v in sorted(vars(cls).items())
                    if k not in _SKIPPED)
        return ("class", cls.__module__, cls.__qualname__, tuple(self.klass(b) for b in cls.__bases__), own)

    def _file_of(self, obj) -> None:
        """The source file `obj` (a function, class or module) was loaded from, where it has one: code typed in or
        made by exec has none, and is described by its bytecode alone."""
        if isinstance(obj, types.FunctionType):
            path = obj.__code__.co_filename
            if not path.startswith("<"):
                self.files.add(path)
            return
        module = obj if isinstance(obj, types.ModuleType) else sys.modules.get(obj.__module__)
        if module is None:
            raise Unstable(f"{obj!r}: its module {obj.__module__!r} is not loaded")
        if not _library(module.__name__) and getattr(module, "__file__", None):
            self.files.add(module.__file__)


def _library(module: str | None) -> bool:
    """Whether code of `module` is PyTorch's or Python's own: named, not described (their versions are named)."""
    top = (module or "").split(".")[0]
    return top in ("torch", "builtins") or top in sys.stdlib_module_names


def _code(code: types.CodeType):
    return (code.co_code, tuple(_code(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts),
            code.co_names, code.co_varnames, code.co_freevars)


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names(c)
    return names


def _file_digest(path: str) -> str:
    try:
        return hashlib.sha256(inputs.read_bytes(path, _SOURCE_LIMIT, "a Python source file")).hexdigest()
    except OSError as e:
        raise Unstable(f"{path}: {e.strerror}") from None
    except GPT2PortError as e:
        raise Unstable(str(e)) from None
