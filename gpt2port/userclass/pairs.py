"""Which vector is which weight's bias, told by what the forward does with it: a bias is the vector added to the
product of an input with a weight (`x @ W_query + bias_q`, `einsum("btc,cd->btd", x, W) + b`, `F.linear(x, W, b)`),
whatever either is called. Watched with a torch function mode over one run of the model (observe.trace)."""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_PRODUCTS = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "einsum", "tensordot", "linear"}
_VIEWS = {"t", "transpose", "T", "mT", "permute", "view", "reshape", "contiguous", "to", "float", "type_as", "__get__"}
_ADDS = {"add", "__add__", "__radd__", "add_", "__iadd__"}


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


class BiasPairs(TorchFunctionMode):
    """pairs: id(bias Parameter) -> id(weight Parameter), for each vector added to a weight's product."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.params = {id(p): p for p in model.parameters() if p.dim() in (1, 2)}
        self.weight_of: dict[int, tuple[torch.Tensor, int]] = {}  # id(tensor) -> (tensor kept alive, id(weight))
        self.pairs: dict[int, int] = {}

    def _weight(self, t) -> int | None:
        if not isinstance(t, torch.Tensor):
            return None
        if id(t) in self.params and t.dim() == 2:
            return id(t)
        hit = self.weight_of.get(id(t))
        return hit[1] if hit is not None and hit[0] is t else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if not isinstance(out, torch.Tensor):
            return out
        if name in _VIEWS and args and self._weight(args[0]) is not None:  # W.t(): still the weight
            self.weight_of[id(out)] = (out, self._weight(args[0]))
        elif name in _PRODUCTS:
            ws = {w for w in (self._weight(a) for a in _flat(args)) if w is not None}
            bias = kwargs.get("bias", args[2] if name == "linear" and len(args) > 2 else None)
            if len(ws) == 1:
                (w,) = ws
                if name == "linear" and isinstance(bias, torch.Tensor) and id(bias) in self.params:
                    self.pairs.setdefault(id(bias), w)
                else:
                    self.weight_of[id(out)] = (out, w)
        elif name in _ADDS and len(args) >= 2:
            a, b = args[0], args[1]
            for prod, vec in ((a, b), (b, a)):
                w = self._weight(prod) if prod is not self.params.get(id(prod)) else None
                if w is not None and isinstance(vec, torch.Tensor) and id(vec) in self.params and vec.dim() == 1:
                    self.pairs.setdefault(id(vec), w)
        return out
