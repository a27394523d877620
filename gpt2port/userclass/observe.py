"""What a user's model class shows about itself: the modules that own parameters, which parameters are one and the
same (a tied head), and the order in which modules actually run on a short input (forward hooks).

Nothing here knows GPT-2; roles.py reads these facts as GPT-2 tensors.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from gpt2port.userclass.calls import call_logits, first_tensor
from gpt2port.userclass.pairs import BiasPairs
from gpt2port.verification.diagnose import eval_mode as evaluating  # the model in eval mode, its modes restored


@dataclass
class Unit:
    """A module that owns parameters directly (not through children)."""
    name: str  # dotted module name, "" for the root
    module: nn.Module
    params: dict[str, nn.Parameter]  # local name -> parameter

    def full(self, local: str) -> str:
        return f"{self.name}.{local}" if self.name else local


@dataclass
class Trace:
    """What one forward pass showed: the order modules were first called in, and the last dimension of the first
    tensor each received and returned. `error` says why there is no trace (the forward could not run)."""
    order: dict[str, int] = field(default_factory=dict)
    in_dim: dict[str, int] = field(default_factory=dict)
    out_dim: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    pairs: dict[int, int] = field(default_factory=dict)  # id(bias) -> id(weight) it is added to (pairs.py)

    def rank(self, name: str, fallback: int) -> tuple[int, int]:
        return (self.order.get(name, 1 << 30), fallback)


def units(model: nn.Module) -> list[Unit]:
    """Every module that owns parameters, in registration order."""
    out = []
    for name, module in model.named_modules(remove_duplicate=False):
        own = {k: p for k, p in module.named_parameters(recurse=False, remove_duplicate=False) if p is not None}
        if own:
            out.append(Unit(name, module, own))
    return out


def aliases(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every full name it is reachable under (two or more: a tied parameter)."""
    out: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(name)
    return out


def device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def probe_ids(model: nn.Module, vocab: int, length: int, seed: int = 0, rows: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, length), generator=g).to(device_of(model))


def trace(model: nn.Module, ids: torch.Tensor) -> Trace:
    """Run the model once on ids with a forward hook on every module; the model's mode and RNG are left as found."""
    t = Trace()
    hooks = []

    def hook(name):
        def record(mod, args, out):
            if name not in t.order:
                t.order[name] = len(t.order)
                a, o = first_tensor(args), first_tensor(out)
                if a is not None and a.dim() and a.is_floating_point():
                    t.in_dim[name] = a.shape[-1]
                if o is not None and o.dim():
                    t.out_dim[name] = o.shape[-1]
        return record

    for name, module in model.named_modules():
        if name:
            hooks.append(module.register_forward_hook(hook(name)))
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), evaluating(model), all_meta(model) as meta, \
                BiasPairs(model) as seen:
            call_logits(model, ids.to("meta") if meta else ids)
        t.pairs = seen.pairs
    except Exception as e:  # noqa: BLE001 - user code; the order is then the registration order (roles.py)
        t.order.clear()
        t.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        for h in hooks:
            h.remove()
    return t


@contextlib.contextmanager
def all_meta(model: nn.Module):
    """A model whose parameters are on the meta device (built under init_empty) is traced on the meta device:
    its real buffers are swapped for meta copies for the duration. Yields whether it is."""
    if not any(p.is_meta for p in model.parameters()):
        yield False
        return
    swapped = []
    for m in model.modules():
        for k, b in m._buffers.items():
            if b is not None and not b.is_meta:
                swapped.append((m, k, b))
                m._buffers[k] = b.to("meta")
    try:
        yield True
    finally:
        for m, k, b in swapped:
            m._buffers[k] = b


# modules whose parameters init_empty() put on the meta device: a buffer such a class made on its parameters' device
# is on meta too, and telling its user to build under init_empty() would send them round in a circle
BUILT_EMPTY: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


@contextlib.contextmanager
def init_empty():
    """Build a model with its parameters on the meta device and its buffers (causal masks) real:

        with gpt2port.init_empty():
            model = MyGPT(cfg)
        gpt2port.load_into(model, "gpt2-xl")   # weights allocated once, as they are loaded

    Parameters are created uninitialised (the init functions do nothing inside this block) and moved to the meta
    device as they are registered, so a 1.5B class costs no memory until load_into fills it. A model built under
    plain `torch.device("meta")` works too: its causal-mask buffers have no values, and load_into gives them back
    (which way round is settled by running the class), at the cost of a comparison model in memory."""
    register = nn.Module.register_parameter
    inits = {n: getattr(nn.init, n) for n in ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_",
                                               "xavier_uniform_", "xavier_normal_", "trunc_normal_", "zeros_",
                                               "ones_", "constant_", "orthogonal_")}

    def to_meta(self, name, param):
        BUILT_EMPTY.add(self)
        register(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = to_meta
    for n in inits:
        setattr(nn.init, n, lambda tensor, *a, **k: tensor)
    try:
        yield
    finally:
        nn.Module.register_parameter = register
        for n, f in inits.items():
            setattr(nn.init, n, f)
