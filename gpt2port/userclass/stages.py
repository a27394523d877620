"""A user's class as verify's Stages: each stage run through the class's own modules, found by its layout.

Every stage is computed by the user's code, not re-implemented: the embeddings are what reaches block 0 in a
forward pass (stopped there). A block's attention and MLP are what its forward adds to the residual stream, seen
at the additions themselves (residual.py): the attention's contribution when the block runs on the given input,
the MLP's when it runs with the attention's contribution left out (so the MLP's LayerNorm sees exactly the given
stream). That holds for attention and MLPs written inline as for modules, and shows a branch scaled before it is
added. A branch not added to the stream the watch follows (post-LN norms the sum before the next addition) is
read at its module's output instead, or else judged within the whole block (localize.py lists it). The final
norm is its module where the forward calls it (and nothing, as the forward does, where it is never called); the
head is its module.
"""

from __future__ import annotations

import torch
from torch import nn

from gpt2port.errors import GPT2PortError
from gpt2port.userclass.facts import stated_eps
from gpt2port.userclass.layout import UserLayout
from gpt2port.userclass.calls import Calls
from gpt2port.userclass.observe import call_logits, first_tensor, probe_ids
from gpt2port.userclass.residual import branches
from gpt2port.verification.stages import Stages


class _Stop(Exception):
    """Raised from a hook once the wanted value is captured: the rest of the forward is not needed."""


class ModelStages(Stages):
    def __init__(self, model: nn.Module, layout: UserLayout):
        cfg = layout.config
        self.model, self.layout, self.mods = model, layout, layout.modules
        self.module = model
        self.n_layer, self.n_head, self.n_embd = cfg.n_layer, cfg.n_head, cfg.n_embd
        self.vocab_size = cfg.vocab_size
        pos = [a for a in layout.assignments if a.target == "pos_emb.weight"]
        self.n_positions = self.model.get_parameter(pos[0].param).shape[-2] if pos else cfg.n_positions
        first = next(model.parameters())
        self.dtype, self.device = first.dtype, first.device
        self.n_params = sum(p.numel() for p in model.parameters())
        self.stated_eps = tuple(stated_eps(model, layout))  # the diagnosis names these where fp32 cannot tell eps apart
        self._final_runs: bool | None = None
        # every stage is re-run with what the model passed its blocks (masks, positions), seen as it ran
        self.calls = Calls(model, [self._block(i) for i in range(self.n_layer)], self.n_embd)

    def _sub(self, name: str | None) -> nn.Module | None:
        return self.model.get_submodule(name) if name else None

    def _block(self, i: int) -> nn.Module:
        return self.model.get_submodule(self.mods.block(i))

    def _inner(self, i: int, rel: str | None) -> nn.Module | None:
        return self._sub(f"{self.mods.block(i)}.{rel}") if rel else None

    def logits(self, ids, keep=None):
        return call_logits(self.model, ids) if keep is None else self.calls.logits(ids, keep)

    def _capture(self, run, module: nn.Module, replace: dict | None = None) -> torch.Tensor:
        """What `module` returns while run() executes (stopped right there); `replace` maps modules to a function
        of their output that replaces it."""
        got = []

        def grab(m, args, out):
            got.append(first_tensor(out))
            raise _Stop

        hooks = [module.register_forward_hook(grab)]
        hooks += [m.register_forward_hook(lambda mod, args, out, f=f: f(out)) for m, f in (replace or {}).items()]
        try:
            run()
        except _Stop:
            pass
        finally:
            for h in hooks:
                h.remove()
        if not got:
            raise GPT2PortError(f"{type(module).__name__}: did not run during the stage")
        return got[0]

    def embeddings(self, ids):
        return self.calls.entry(ids)

    def _part(self, layer: int, whole: str | None, out: str | None, what: str) -> nn.Module:
        """The module whose output is a sub-layer's contribution: the sub-layer itself, or else its last projection
        (attention or MLP written inline in the block's forward)."""
        module = self._inner(layer, whole or out)
        if module is None:
            raise GPT2PortError(f"{self.mods.block(layer)}: its {what} has no module of its own, nor a projection "
                                f"module to read its output from; it cannot be checked apart from the whole block")
        return module

    def attention(self, layer, x):
        seen = branches(lambda y: self.calls.run(layer, y), x, 1)
        if seen is not None:
            return seen
        attn = self._part(layer, self.mods.attn, self.mods.attn_out, "attention")
        return self._capture(lambda: self.calls.run(layer, x), attn)

    def mlp(self, layer, x):
        # The attention's contribution left out: the MLP's LayerNorm sees exactly the given stream.
        seen = branches(lambda y: self.calls.run(layer, y), x, 2)
        if seen is not None:
            return seen
        attn = self._part(layer, self.mods.attn, self.mods.attn_out, "attention")
        mlp = self._part(layer, self.mods.mlp, self.mods.mlp_out, "MLP")
        return self._capture(lambda: self.calls.run(layer, x), mlp, {attn: _zeros})

    def whole_block(self, layer, x):
        """The block's output on x, run as the model runs it (for a block whose parts agree, but not the whole)."""
        return self.calls.run(layer, x)

    @property
    def activation(self) -> str | None:
        """Block 0's MLP activation as measured (activations.py's name; "unknown": none known; None: not
        measured): the diagnosis never names an activation the class does not have."""
        if not hasattr(self, "_activation"):
            from gpt2port.userclass.activation import TOLERANCE, measure

            errors = measure(self.model, self.layout)
            best = min(errors, key=errors.get) if errors else None
            self._activation = best if best is None or errors[best] <= TOLERANCE else "unknown"
        return self._activation

    def final_norm(self, x):
        return self._sub(self.mods.final_norm)(x) if self.final_runs() else x

    def final_runs(self) -> bool:
        """Whether the forward calls the final norm (a class may define one and never call it)."""
        if self._final_runs is None:
            ran = []
            h = self._sub(self.mods.final_norm).register_forward_hook(lambda *a: ran.append(True))
            try:
                with torch.no_grad(), torch.random.fork_rng(devices=[]):
                    call_logits(self.model, probe_ids(self.model, self.vocab_size, 4))
                self._final_runs = bool(ran)
            except Exception:  # noqa: BLE001 - a forward that cannot run is judged elsewhere; take the module
                self._final_runs = True
            finally:
                h.remove()
        return self._final_runs

    def head(self, x):
        head = self._sub(self.mods.head)
        if head is not None:
            return head(x)
        wte = self.model.get_parameter(next(a.param for a in self.layout.assignments if a.target == "tok_emb.weight"))
        return x @ wte.t()  # a head written inline as the tied embedding's transpose


def _zeros(out):
    """A module's output with its first tensor replaced by zeros (nn.MultiheadAttention returns a tuple)."""
    if isinstance(out, tuple):
        return (torch.zeros_like(out[0]), *out[1:])
    return torch.zeros_like(out)


def stages_for(model: nn.Module, reference=None, report=None) -> ModelStages:
    """A user's class as Stages: read the way load_into filled it (its LoadReport: `report`, or the one recorded on
    the model), or else as the GPT-2 at `reference` is shaped."""
    from gpt2port.userclass.record import loaded
    from gpt2port.userclass.roles import layout_of

    report = loaded(model, report)
    given = None if hasattr(reference, "forward") else reference
    lay = report.layout if report is not None else layout_of(model, given)
    if lay.reasons:
        raise GPT2PortError(f"{lay.model_name}: cannot be verified as GPT-2: {lay.reasons[0]}")
    stages = ModelStages(model, lay)
    stages.history = tuple(report.history) if report is not None else ()
    return stages
