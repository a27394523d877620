"""A user's model as it runs: what each block receives and returns, recorded from runs of the whole model.

A block is whatever the class calls: a module called with the residual stream and whatever else the model passes
(a causal mask, positions, `is_causal=True`: torch's nn.TransformerEncoderLayer), or a container the model never
calls itself (an einops `nn.ModuleList([attn, ff])` pair, run as `x = attn(x) + x; x = ff(x) + x`). Forward
pre-hooks (with keyword arguments) on every module record, for each block, its entry: the first module of the
block the forward calls, and all its arguments. Where the block itself is called, its return is its output;
where it is not, the stream that reaches the next module outside it (the next block, the final norm) is.

A stage is re-run only with what the model itself passed: a block called as a module is called again with the
recorded arguments, the residual stream alone replaced; a block the model runs piece by piece is run by the model
itself on the recorded input, the stream entering the block swapped for the given one (a torch function mode
replaces that very tensor wherever the forward uses it, the residual addition included). A compiled model
(torch.compile) runs its eager module (`_orig_mod`), whose hooks fire. A block that no run reaches is unobserved:
GPT2PortError, and verify judges the model whole, naming that stage.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from gpt2port.errors import GPT2PortError

# a forward's required arguments beyond the tokens that gpt2port can fill, by what they mean
TARGETS = ("targets", "labels", "target", "y", "next_tokens")
MASKS = ("attention_mask", "mask", "attn_mask", "padding_mask", "key_padding_mask")


class _End(Exception):
    """What was wanted is captured: the rest of the forward is not needed."""


@dataclass
class Entry:
    """How the model entered one block on inputs of one shape."""
    module: nn.Module  # the block itself (called) or the first of its modules the forward called
    called: bool
    args: tuple
    kwargs: dict
    place: tuple  # where the stream is: ("arg", i) or ("kw", name); its slot holds None (not kept alive)
    ids: torch.Tensor  # the model's input of that run
    dtype: torch.dtype


def first_tensor(x):
    """The first tensor in a module's input or output (a tensor, or a tuple/list/dict holding one)."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (tuple, list)):
        for item in x:
            t = first_tensor(item)
            if t is not None:
                return t
    logits = getattr(x, "logits", None)  # a ModelOutput-style object
    return logits if isinstance(logits, torch.Tensor) else None


def eager(model: nn.Module) -> nn.Module:
    """The module whose forward runs eagerly: torch.compile's wrapper keeps the user's model as `_orig_mod`."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model


def forward_args(model: nn.Module, ids: torch.Tensor) -> dict:
    """The forward's required arguments beyond the tokens, filled with what they mean (targets: the next tokens;
    a mask: ones), or GPT2PortError naming the one that cannot be known."""
    try:
        params = list(inspect.signature(eager(model).forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    out = {}
    for p in params[1:]:
        if p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in TARGETS:
            out[p.name] = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
        elif p.name in MASKS:
            out[p.name] = torch.ones_like(ids)
        else:
            raise GPT2PortError(f"{type(eager(model)).__name__}.forward requires `{p.name}`, which gpt2port cannot "
                                f"fill (it fills targets and masks): wrap the model in a module whose forward(idx) "
                                f"calls it with that argument")
    return out


def call(model: nn.Module, ids: torch.Tensor, **extra):
    """The model's forward on ids, with the required arguments it has filled (forward_args)."""
    return eager(model)(ids, **{**forward_args(model, ids), **extra})


def call_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits for every position of ids, whatever its forward returns: logits, (logits, loss), a dict
    or an object with .logits. A forward that returns only the last position unless given targets (nanoGPT at
    inference) is called again with targets=ids. Required arguments beyond the tokens: calls.forward_args."""
    out = first_tensor(call(model, ids))
    if out is None:
        raise GPT2PortError(f"{type(model).__name__}.forward returned no tensor")
    if out.dim() == 3 and out.shape[1] == 1 and ids.shape[1] > 1:
        params = inspect.signature(eager(model).forward).parameters
        key = next((k for k in TARGETS if k in params), None)
        if key is None:
            raise GPT2PortError(f"{type(model).__name__}.forward returns only the last position's logits; "
                                f"gpt2port needs every position's")
        out = first_tensor(call(model, ids, **{key: ids}))
    return out


def _place(args: tuple, kwargs: dict, width: int) -> tuple | None:
    """Where the residual stream is among a call's arguments: the first floating tensor of that width."""
    def fits(t):
        return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2 and t.shape[-1] == width
    for i, a in enumerate(args):
        if fits(a):
            return ("arg", i)
    return next((("kw", k) for k, v in kwargs.items() if fits(v)), None)


def _get(args, kwargs, place):
    return args[place[1]] if place[0] == "arg" else kwargs[place[1]]


def _put(args, kwargs, place, value, dtype=None):
    """args/kwargs with `value` at the stream's place (and floating tensors cast to `dtype` where given)."""
    def cast(t):
        return t.to(dtype) if dtype is not None and isinstance(t, torch.Tensor) and t.is_floating_point() else t
    args, kwargs = [cast(a) for a in args], {k: cast(v) for k, v in kwargs.items()}
    if place[0] == "arg":
        args[place[1]] = value
    else:
        kwargs[place[1]] = value
    return tuple(args), kwargs


class _Swap(TorchFunctionMode):
    """Wherever the forward uses the tensor `old`, it uses `new` instead."""

    def __init__(self):
        super().__init__()
        self.old, self.new = None, None

    def _sub(self, a):
        if a is self.old and self.old is not None:
            return self.new
        if isinstance(a, (list, tuple)) and any(x is self.old for x in a):
            return type(a)(self.new if x is self.old else x for x in a)
        return a

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.old is None:
            return func(*args, **(kwargs or {}))
        return func(*(self._sub(a) for a in args), **{k: self._sub(v) for k, v in (kwargs or {}).items()})


class Calls:
    """The blocks of a model as it runs them (see the module's doc). `blocks`: the block modules, in order."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], width: int):
        self.model, self.blocks, self.width = model, blocks, width
        self.owner: dict[int, int] = {}
        for i, b in enumerate(blocks):
            for m in b.modules():
                self.owner.setdefault(id(m), i)
        self.entries: list[dict[tuple, Entry]] = [{} for _ in blocks]

    def _hooks(self, pre, post=None):
        hooks = [m.register_forward_pre_hook(pre(m), with_kwargs=True) for m in eager(self.model).modules()]
        if post is not None:
            hooks += [b.register_forward_hook(post(i)) for i, b in enumerate(self.blocks)]
        return hooks

    def logits(self, ids: torch.Tensor, keep=None):
        """The model's output on ids (whatever its forward returns), each block's entry recorded; keep(stream)
        gets the stream entering block 0, then the one after each block, as far as they are seen."""
        state = {"open": None, "seen": set()}  # open: an uncalled block whose output is the next stream outside

        def close(stream):
            state["open"] = None
            if keep is not None:
                keep(stream.detach())

        def pre(m):
            def hook(mod, args, kwargs):
                i = self.owner.get(id(m))
                place = _place(args, kwargs, self.width)
                if place is None or i in state["seen"] and i is not None:
                    return None
                stream = _get(args, kwargs, place)
                if state["open"] is not None and i != state["open"]:
                    close(stream)
                if i is None:
                    return None
                state["seen"].add(i)
                args_kept, kwargs_kept = _put(args, kwargs, place, None)
                self.entries[i][tuple(stream.shape)] = Entry(m, m is self.blocks[i], args_kept, kwargs_kept, place,
                                                             ids, stream.dtype)
                if i == 0 and keep is not None:
                    keep(stream.detach())
                if m is not self.blocks[i]:
                    state["open"] = i
                return None
            return hook

        def post(i):
            def hook(mod, args, out):
                if state["open"] is None and i in state["seen"]:
                    t = first_tensor(out)
                    if t is not None and keep is not None:
                        keep(t.detach())
            return hook

        hooks = self._hooks(pre, post)
        try:
            return call_logits(self.model, ids)
        finally:
            for h in hooks:
                h.remove()

    def entry(self, ids: torch.Tensor) -> torch.Tensor:
        """The stream entering block 0 (the embeddings), the forward stopped there."""
        got = []

        def keep(x):
            got.append(x)
            raise _End

        try:
            self.logits(ids, keep)
        except _End:
            pass
        if not got:
            raise GPT2PortError("the embeddings: no block was seen to receive the residual stream")
        return got[0]

    def _entry(self, i: int, shape: tuple) -> Entry:
        if tuple(shape) not in self.entries[i] and len(shape) == 3:
            try:
                with torch.no_grad(), torch.random.fork_rng(devices=[]):
                    self.logits(torch.zeros(shape[:2], dtype=torch.long, device=_device(self.model)))
            except GPT2PortError:
                raise
            except Exception:  # noqa: BLE001 - a forward that cannot run: the block is unobserved
                pass
        e = self.entries[i].get(tuple(shape))
        if e is None:
            raise GPT2PortError(f"block {i}: not seen running: the model's forward called neither it nor any module "
                                f"in it with the residual stream")
        return e

    def run(self, i: int, x: torch.Tensor):
        """Block i on the stream x, with what the model passed it; its output (the first tensor it returns, or
        the stream that leaves it)."""
        e = self._entry(i, x.shape)
        dtype = x.dtype if x.dtype != e.dtype else None
        if e.called:
            args, kwargs = _put(e.args, e.kwargs, e.place, x, dtype)
            return first_tensor(e.module(*args, **kwargs))
        swap, got = _Swap(), []

        def pre(m):
            def hook(mod, args, kwargs):
                place = _place(args, kwargs, self.width)
                if place is None:
                    return None
                if swap.old is None and self.owner.get(id(m)) == i:
                    swap.old, swap.new = _get(args, kwargs, place), x
                    return _put(args, kwargs, place, x)
                if swap.old is not None and self.owner.get(id(m)) != i:
                    got.append(_get(args, kwargs, place))
                    raise _End
                return None
            return hook

        hooks = self._hooks(pre)
        try:
            with swap:
                call(self.model, e.ids)
        except _End:
            pass
        finally:
            for h in hooks:
                h.remove()
        if not got:
            raise GPT2PortError(f"block {i}: the stream leaving it reaches no module (the final norm or the next "
                                f"block): its output cannot be seen")
        return got[0]


def calls_for(model: nn.Module, lay) -> Calls:
    """The Calls of a class read as `lay` (a UserLayout): its n_layer blocks at the width it has."""
    blocks = [model.get_submodule(lay.modules.block(i)) for i in range(lay.config.n_layer)]
    return Calls(model, blocks, lay.config.n_embd)


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
