"""load_into: GPT-2's weights, from anything gpt2port reads, into a user's own model class.

The class is read as GPT-2 (roles.py); a class that cannot hold GPT-2 is refused before any weight is touched, one
line per reason. The source's canonical tensors stream by one at a time and each is copied into every parameter
that holds it (or part of it): into the existing Parameters of an allocated model (optimizers made before stay
valid), or into fresh tensors assigned to a model built on the meta device (peak memory: the model and one tensor).
"""

from __future__ import annotations

import time
from pathlib import Path
from dataclasses import dataclass, field

import torch
from torch import nn

from gpt2port.checkpoint import is_checkpoint, load_state, read_manifest
from gpt2port.config import GPTConfig
from gpt2port.conversion import canonical_items
from gpt2port.errors import GPT2PortError
from gpt2port.layouts import GPT2PORT, canonical
from gpt2port.sources import open_source, source_path
from gpt2port.userclass.activation import ERF, GPT2, identify, said
from gpt2port.userclass.layout import Assignment, UserLayout
from gpt2port.userclass.observe import BUILT_EMPTY, probe_ids, trace
from gpt2port.userclass.proof import against_gpt2, prove, reference
from gpt2port.userclass.record import record
from gpt2port.userclass.roles import context, infer, read_class
from gpt2port.userclass.settle import bias_cost, reference_gpt, settle
from gpt2port.verification import history




class LoadRefused(GPT2PortError):
    """The class cannot hold GPT-2 as it is (or, loaded, does not compute it); `reasons` has one line each."""

    def __init__(self, model_name: str, reasons: list[str], what: str = "cannot hold these GPT-2 weights"):
        self.reasons, self.what = reasons, what
        super().__init__(f"{model_name} {what}:\n" + "\n".join(f"  {r}" for r in reasons))


@dataclass
class LoadReport:
    source: str
    layout: UserLayout
    config: GPTConfig
    notes: list[str] = field(default_factory=list)
    cost: dict | None = None  # what dropping GPT-2's biases costs, measured (drop_biases=True)
    seconds: float = 0.0
    # the loaded class against a float64 GPT-2 over the source (proof.py): rel, tokens, tolerance, against, ...
    proof: dict | None = None
    # what verify should know (verification/history.py): biases dropped, positions cropped, the exact GELU, and
    # the source checkpoint's own record (fine-tuned from a parent)
    history: list[dict] = field(default_factory=list)

    @property
    def proven(self) -> str:
        """What the load proved, in one line."""
        p = self.proof
        if not p:
            return "nothing proven"
        line = f"logits equal {p['against']} to {p['rel']:.2g} relative on {p['words']}"
        if p.get("gpt2_rel") is not None:
            line += f"; against GPT-2's own tanh GELU they differ by {p['gpt2_rel']:.2g}"
        return line

    def __str__(self) -> str:
        lines = [f"loaded {self.source} into {self.layout.model_name} in {self.seconds:.2f} s", str(self.layout)]
        lines.append(f"proof: {self.proven}")
        lines += [f"note: {n}" for n in self.notes if n not in self.layout.notes]
        if self.cost:
            c = self.cost
            lines.append(f"cost of the dropped biases vs GPT-2: max rel logit error {c['max_rel']:.3g}, "
                         f"KL {c['kl_mean']:.3g}, top-1 agreement {c['top1']:.1%}; its greedy continuation is "
                         f"GPT-2's for the first {round(c['greedy_agreement'] * c['greedy_tokens'])} of "
                         f"{c['greedy_tokens']} tokens")
        return "\n".join(lines)


def load_into(model: nn.Module, source, *, tie: bool | None = None, crop_positions: bool = False,
              drop_biases: bool = False) -> LoadReport:
    """Fill `model` (any nn.Module shaped as a GPT-2) with the weights at `source` (a gpt2port checkpoint directory
    or NAME, a Hugging Face directory or weights file, or any other source `gpt2port convert` reads).

    tie: None keeps the class's head as it is (tied, or an untied copy of the token embedding); True makes an
    untied head the embedding's own Parameter. crop_positions: a class with a shorter context keeps the first rows
    of the position table. drop_biases: a class without some of GPT-2's biases loads the rest, and the report
    measures what the missing biases cost against GPT-2.
    """
    t0 = time.perf_counter()
    path = source_path(source)
    with open_source(path) as src:
        config = src.config
        meta = any(p.is_meta for p in model.parameters())
        lay, pk, tr = read_class(model, config, crop_positions, run=not meta)
        act_notes: list[str] = []
        untied_source = not getattr(config, "tie_word_embeddings", True)
        reasons = list(lay.reasons) + _head_reasons(lay, untied_source, tie) + _activation(model, lay, act_notes)
        if lay.missing_biases and not drop_biases:
            reasons.append(_bias_reason(lay, src))
        masks = empty_buffers(model)
        odd = [name for name, (m, k, b) in masks.items() if b.dim() < 2 or b.shape[-1] != b.shape[-2]]
        if odd:
            more = f" (and {len(odd) - 1} more)" if len(odd) > 1 else ""
            fix = ("the class was built under gpt2port.init_empty(), so a buffer made on its parameters' device is "
                   "on meta too: create it on the CPU (device='cpu'), or compute it in forward"
                   if any(m in BUILT_EMPTY for m in model.modules()) else
                   "build the class under gpt2port.init_empty() (parameters on meta, buffers real)")
            reasons.append(f"{odd[0]}{more}: a buffer on the meta device has no values, and is no causal mask to "
                           f"rebuild; {fix}")
        if reasons:
            raise LoadRefused(lay.model_name, reasons)
        lay = _retarget(lay, untied_source)
        candidates = pk.combinations()
        if masks:  # which way round the class keeps its causal masks is one more thing to settle by numbers
            candidates = [{**c, MASK: i} for c in candidates for i in range(len(MASK_FILLS))]
            fill_masks(masks, 0)
        keep = len(candidates) > 1 or drop_biases
        items, shared = _items(model, src)
        kept = fill(model, lay.assignments, items, keep, shared)
        if meta:  # it can run now: read it again with the order its modules run in, and refill if that differs
            tr = trace(model, probe_ids(model, config.vocab_size, min(8, context(model, lay))))
            again = _retarget(infer(model, config, tr, crop=crop_positions)[0], untied_source)
            if not again.reasons:
                if again.assignments != lay.assignments:
                    kept = fill(model, again.assignments, canonical_items(src, dtype=None), keep)
                lay = again
    ref = reference_gpt(config, kept) if keep else None
    if len(candidates) > 1:
        def build(opts):
            cand, cpk = infer(model, config, tr, opts, crop=crop_positions)
            if masks:
                fill_masks(masks, opts.get(MASK, 0))
                cpk.choices[MASK] = list(MASK_FILLS)
            return _retarget(cand, untied_source), cpk

        meta_masks = (f"; its buffers ({', '.join(list(masks)[:2])}{' ...' if len(masks) > 2 else ''}) were built "
                      f"on the meta device, without values, and no causal mask rebuilt in them computes GPT-2: build "
                      f"the class under gpt2port.init_empty() (parameters on meta, buffers real)")
        try:
            lay = settle(model, lay, candidates, build, ref, kept, config, fill)
        except GPT2PortError as e:
            if not masks:
                raise
            raise GPT2PortError(f"{e}{meta_masks}") from e
        if lay.unsettled and masks:
            lay.unsettled += meta_masks
    lay.notes += [n for n in act_notes if n not in lay.notes]
    notes = list(lay.notes)
    if tie and not lay.tied:
        _tie(model, lay)
        notes.append(f"{lay.head_param}: tied to the token embedding on request (tie=True)")
    elif not lay.tied:
        notes.append(f"{lay.head_param}: untied; " + ("holds the checkpoint's own head" if untied_source else
                                                      "holds a copy of the token embedding"))
    if drop_biases and lay.missing_biases:
        notes.append("GPT-2's biases dropped on request (drop_biases=True): " + ", ".join(lay.missing_biases))
    cost = bias_cost(model, ref, config, lay) if drop_biases and lay.missing_biases else None
    erf = any(said(ERF) in n for n in act_notes)
    zeroed = {t.format(i) for t in lay.missing_bias_targets for i in range(config.n_layer)} if drop_biases else set()
    proof = _prove(model, lay, path, config, zeroed, erf)
    report = LoadReport(str(path), lay, config, notes, cost, time.perf_counter() - t0, proof,
                        _history(model, lay, path, config, zeroed, erf))
    record(model, report)  # model.gpt2port_load: its settled layout and history serve verify_model and save_from
    return report


def _prove(model: nn.Module, lay: UserLayout, path, config: GPTConfig, zeroed: set[str], erf: bool) -> dict:
    """The loaded class against a float64 GPT-2 over the source (with the biases it dropped at zero, and the exact
    GELU where it has one), stage by stage; a refusal names the first stage that differs."""
    def load_all():
        with open_source(path) as s:
            return {k: produce() for k, _, _, produce in canonical_items(s, dtype=None)}

    with reference(path, config, load_all, zeroed, erf) as ref:
        proof = prove(model, lay, ref)
    if lay.unsettled:
        where = f"; read so, on {proof['words']}: {proof['first_divergence']}" if not proof["passed"] else ""
        raise LoadRefused(lay.model_name, [lay.unsettled + where], "does not compute GPT-2 in any reading")
    if not proof["passed"]:
        raise LoadRefused(lay.model_name, [f"on {proof['words']}: {proof['first_divergence']}; its parameters "
                                           f"now hold GPT-2's weights"],
                          "holds GPT-2's weights but does not compute GPT-2")
    proof["against"] = "GPT-2's" + (" with the exact (erf) GELU" if erf else "") + \
        (" without the dropped biases" if zeroed else "")
    if erf:
        with reference(path, config, load_all, zeroed) as ref:
            proof["gpt2_rel"] = against_gpt2(model, lay, ref)
    return proof


def _history(model: nn.Module, lay: UserLayout, path, config: GPTConfig, zeroed: set[str], erf: bool) -> list[dict]:
    events = [history.dropped_biases(sorted(zeroed))] if zeroed else []
    pos = [a for a in lay.assignments if a.target == canonical.POSITIONS]
    rows = model.get_parameter(pos[0].param).shape[-2] if pos else config.n_positions
    if rows < config.n_positions:
        events.append(history.cropped_positions(rows, config.n_positions))
    if erf:
        events.append(history.erf_gelu(mlp_name(lay)))
    if is_checkpoint(Path(path)):
        events += history.from_manifest(read_manifest(Path(path)))
    return events


MASK = "causal-mask buffers built on the meta device"
MASK_FILLS = ("ones on and below the diagonal (attend where 1)", "ones above the diagonal (masked where 1)")


def empty_buffers(model: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """Buffers without values (a class built under torch.device('meta')), by name."""
    return {f"{name}.{k}" if name else k: (m, k, b) for name, m in model.named_modules()
            for k, b in m._buffers.items() if b is not None and b.is_meta}


def fill_masks(masks: dict, kind: int) -> None:
    """Give meta-device square buffers the values of a causal mask: GPT-2's only buffers are its masks, kept either
    as ones where a position may attend (tril) or as ones where it may not (triu above the diagonal); which of the
    two a class uses is settled by running it."""
    for m, k, b in masks.values():
        n = b.shape[-1]
        base = torch.ones(n, n).tril() if kind == 0 else torch.ones(n, n).triu(1)
        m._buffers[k] = base.to(b.dtype).expand(b.shape).clone()


def _items(model: nn.Module, src) -> tuple[list, bool]:
    """The source's canonical tensors, streamed; or, for a model built on the meta device from a gpt2port
    checkpoint, the checkpoint's own memory-mapped tensors, which parameters can then share instead of copying
    (copy-on-write, as GPT.from_pretrained loads: changing them never writes to the file)."""
    if src.layout is GPT2PORT and is_checkpoint(src.root) and any(p.is_meta for p in model.parameters()):
        _, _, mapped = load_state(src.root)
        return [(k, t.dtype, tuple(t.shape), (lambda t=t: t)) for k, t in mapped.items()], True
    return canonical_items(src, dtype=None), False


def _retarget(lay: UserLayout, untied_source: bool) -> UserLayout:
    """An untied class loaded from a checkpoint with its own head takes that head, not the embedding."""
    if untied_source and not lay.tied:
        lay.assignments = [a if a.param != lay.head_param else Assignment(a.param, canonical.HEAD, a.transform)
                           for a in lay.assignments]
    return lay


def _activation(model: nn.Module, lay: UserLayout, notes: list[str]) -> list[str]:
    """A refusal for an MLP whose activation is not GELU; a note for the exact GELU in place of GPT-2's tanh one.
    Measured on probe weights (activation.py), never on the values the class happens to hold."""
    m = identify(model, lay)
    if m is None or m.name == GPT2:
        return []  # None: the proof at the end of the load judges the class as a whole
    where = mlp_name(lay)
    if m.name == ERF:
        notes.append(f"{where}: the activation measures as {said(ERF)}; GPT-2's is the tanh "
                     f"approximation (nn.GELU(approximate='tanh')): logits will differ slightly")
        return []
    exact = f" (to {m.err:.1g})" if m.words.startswith("measures as") else ""
    return [f"{where}: the activation between the MLP's layers {m.words}{exact}; GPT-2 uses {said(GPT2)}"]


def mlp_name(lay: UserLayout) -> str:
    """Block 0's MLP, named by its module (or the block, where the MLP is written in the block's forward)."""
    return f"{lay.modules.block(0)}.{lay.modules.mlp}" if lay.modules.mlp else lay.modules.block(0)


def _head_reasons(lay: UserLayout, untied_source: bool, tie) -> list[str]:
    head = lay.modules.head or "the head"
    if untied_source and (lay.tied or tie):
        return [f"{head}: the checkpoint's head is not tied to its token embedding; a tied head would change the "
                f"model: give the class its own head Parameter"]
    if tie is False and lay.tied:
        return [f"{head}: tie=False, but the class ties its head to the token embedding (one Parameter)"]
    return []


def _bias_reason(lay: UserLayout, src) -> str:
    """Which modules lack GPT-2's biases, and how large those biases are in this checkpoint."""
    wanted = {t.format(0) for t in lay.missing_bias_targets}
    sizes = []
    for key, _, _, produce in canonical_items(src, dtype=None):
        if key in wanted:
            b = produce().float()
            sizes.append(f"{key.removeprefix('blocks.0.').removesuffix('.bias')} mean |b| {b.abs().mean():.3g}, "
                         f"max {b.abs().max():.3g}")
    shown = ", ".join(lay.missing_biases[:6]) + (" ..." if len(lay.missing_biases) > 6 else "")
    beside = [r.split(":")[0] for r in lay.reasons if r.endswith("that belongs to no weight")]
    if any(v.rsplit(".", 1)[0] in (m, m.rsplit(".", 1)[0]) for v in beside for m in lay.missing_biases):
        # the class has vectors there, unpaired: advice to build with bias=True would contradict it
        return (f"{shown}: no bias paired with them, though {', '.join(beside[:3])} sit beside them: add each to "
                f"its weight's product in the forward (x @ W + b), so that it reads as that weight's bias")
    return (f"{shown}: no bias, but GPT-2 has one there (in block 0 of this checkpoint: {'; '.join(sizes)}); build "
            f"those layers with bias=True (every block), or pass drop_biases=True to load the rest and measure the "
            f"cost")


def _owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """id(parameter) -> every (module, attribute) holding it: a tied parameter is replaced everywhere at once."""
    out: dict[int, list] = {}
    for m in model.modules():
        for k, p in m._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((m, k))
    return out


@torch.no_grad()
def fill(model: nn.Module, assignments: list[Assignment], items, keep: bool,
         shared: bool = False) -> dict[str, torch.Tensor]:
    """Copy each canonical tensor, as it streams by, into every parameter that holds it (`shared`: the tensors are
    the checkpoint's own mapped ones, which a parameter on the meta device may take as they are). Returns the
    canonical tensors when `keep` (to compare candidates against gpt2port's own GPT), else {}."""
    by_target: dict[str | None, list[Assignment]] = {}
    for a in assignments:
        by_target.setdefault(a.target, []).append(a)
    owners = _owners(model)
    kept = {}
    for key, _, _, produce in items:
        rows = by_target.get(key, [])
        if not rows and not keep:
            continue
        t = produce()
        for a in rows:
            put(model, owners, a.param, a.transform.to_layout(t), shared and len(rows) == 1)
        if keep:
            kept[key] = t.clone()
    for a in by_target.get(None, []):
        p = model.get_parameter(a.param)
        put(model, owners, a.param, torch.zeros(p.shape, dtype=p.dtype))
    return kept


def put(model: nn.Module, owners: dict, name: str, value: torch.Tensor, shared: bool = False) -> None:
    """Copy `value` into the parameter `name`; a parameter on the meta device gets a tensor of its own (or, when
    `shared`, `value` itself where it already has the right dtype and memory layout)."""
    p = model.get_parameter(name)
    if tuple(p.shape) != tuple(value.shape):
        raise GPT2PortError(f"{name}: the class's parameter is {tuple(p.shape)}, GPT-2's tensor for it is "
                            f"{tuple(value.shape)}")
    if not p.is_meta:
        p.copy_(value)
        return
    if not (shared and value.dtype == p.dtype and value.is_contiguous()):
        value = torch.empty(p.shape, dtype=p.dtype).copy_(value)
    new = nn.Parameter(value, requires_grad=p.requires_grad)
    pairs = owners.pop(id(p))
    for module, attr in pairs:
        module._parameters[attr] = new
    owners[id(new)] = pairs


def _owners_of(model: nn.Module, p) -> list[tuple[nn.Module, str]]:
    return [(m, k) for m in model.modules() for k, q in m._parameters.items() if q is p]


def _tie(model: nn.Module, lay: UserLayout) -> None:
    wte = model.get_parameter(next(a.param for a in lay.assignments if a.target == canonical.EMBEDDING))
    head = model.get_parameter(lay.head_param)
    if head.shape != wte.shape:
        raise GPT2PortError(f"{lay.head_param}: stored {tuple(head.shape)}, the token embedding is "
                            f"{tuple(wte.shape)}; tie=True needs the same shape")
    for module, attr in _owners_of(model, head):
        module._parameters[attr] = wte
    lay.tied = True
    lay.assignments = [a for a in lay.assignments if a.param != lay.head_param]
