"""save_from: a user's class written back as a gpt2port checkpoint, through the layout's inverse, and proven.

Every parameter goes back through its transform (q, k and v parts, or one per head, merged into GPT-2's fused
projection; Conv1D-style weights transposed back). The head is never silently re-tied or dropped: an untied head
that still equals the token embedding is stored once, as GPT-2 stores it; one that differs (fine-tuned) is kept as
the checkpoint's own head. A bias GPT-2 does not have (a head bias) is dropped only while it is zero; a bias GPT-2
has and the class lacks is written as zeros, which computes exactly the class.

Nothing is guessed: sizes come from the loaded layout or from the class itself, and its head count, activation
and LayerNorm eps are measured (facts.py); what cannot be is asked for (config=...). The checkpoint is written to
a staging directory, loaded into gpt2port's GPT and compared with the class on two sequences over its whole
context (batched and apart); only a checkpoint that computes the class takes the output's place.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from torch import nn

from gpt2port import checkpoint, records
from gpt2port.config import GPTConfig
from gpt2port.errors import GPT2PortError
from gpt2port.filekind import real
from gpt2port.fsio import refuse_overlap, staged_directory, write_mark
from gpt2port.layouts import canonical
from gpt2port.layouts.transforms import merge
from gpt2port.activations import DISTINCT, TABLE, words
from gpt2port.userclass.activation import identify
from gpt2port.userclass.facts import Found, Missed, eps_hints, measure
from gpt2port.userclass.layout import UserLayout
from gpt2port.userclass.record import loaded
from gpt2port.userclass.proof import proof_ids, proof_words
from gpt2port.userclass.roles import FACTS, as_config, context, own_layout
from gpt2port.userclass.settle import run

# fp32 rounding grows with depth and activation scale (past 1e-5 at 124M with trained-scale weights); a wrong head
# count, GELU or bias costs 1e-3 and more. fp16/bf16 on either side: 3e-2.
PROOF_REL = {torch.float32: 1e-4, torch.float64: 1e-4}


def canonical_state(model: nn.Module, lay: UserLayout) -> tuple[GPTConfig, dict[str, torch.Tensor], list[str]]:
    """(the config the class is, its weights as GPT-2's canonical tensors, the biases written as zeros because
    the class has none: '{}' for the layer)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    rows = {a.target: [] for a in lay.assignments}
    for a in lay.assignments:
        rows[a.target].append(a)
    for a in rows.pop(None, []):
        if bool(params[a.param].detach().ne(0).any()):
            raise GPT2PortError(f"{a.param}: is no longer zero; GPT-2 has no such bias ({a.note}), so a GPT-2 "
                                f"checkpoint cannot hold this model")
    config = lay.config
    pos = rows.get(canonical.POSITIONS)
    if pos:  # a class with a shorter context (crop_positions) is saved as the GPT-2 it is
        config = dataclasses.replace(config, n_positions=params[pos[0].param].shape[-2])
    head = [a for a in rows.get(canonical.EMBEDDING, []) + rows.pop(canonical.HEAD, []) if a.param == lay.head_param]
    if head:
        rows[canonical.EMBEDDING] = [a for a in rows[canonical.EMBEDDING] if a.param != lay.head_param]
    shapes = canonical.shapes(config)
    zeros = {t.format(i) for t in lay.missing_bias_targets for i in range(config.n_layer)}
    state = {}
    with torch.no_grad():
        for name, shape in shapes.items():
            if name in rows:
                parts = [(a.transform, params[a.param].detach().cpu()) for a in rows[name]]
                state[name] = merge(parts, shape).contiguous()
        dtype = state[canonical.EMBEDDING].dtype if canonical.EMBEDDING in state else torch.float32
        for name in zeros - set(state):
            state[name] = torch.zeros(shapes[name], dtype=dtype)
        if head:
            h = head[0].transform.from_layout(params[lay.head_param].detach().cpu(), shapes[canonical.EMBEDDING])
            if not torch.equal(h, state[canonical.EMBEDDING]):
                config = dataclasses.replace(config, tie_word_embeddings=False)
                state[canonical.HEAD] = h.contiguous()
    missing = [k for k in canonical.shapes(config) if k not in state]
    if missing:
        raise GPT2PortError(f"{lay.model_name}: holds no {', '.join(missing[:4])}; it cannot be saved as GPT-2")
    return config, state, sorted(lay.missing_bias_targets)


class Saved(type(Path())):
    """The checkpoint's path, carrying the SaveReport (`.report`) of what was written and proven."""

    report: "SaveReport"


@dataclasses.dataclass
class SaveReport:
    path: Path
    model_name: str
    config: GPTConfig
    max_rel: float
    tokens: int
    notes: list[str]

    @property
    def proven(self) -> str:
        how = "exactly" if self.max_rel == 0 else f"to {self.max_rel:.1g} (max relative)"
        return f"gpt2port's GPT over the saved checkpoint gives logits equal to {self.model_name}'s {how} on " \
               f"{proof_words(self.tokens)}"

    def __str__(self) -> str:
        return "\n".join([f"saved {self.model_name} to {self.path}", f"proven: {self.proven}"] +
                         [f"note: {n}" for n in self.notes])


def save_from(model: nn.Module, out: str | Path, *, dtype=None, force: bool = False, config=None,
              report=None) -> Saved:
    """Write a user's class (e.g. after fine-tuning, or trained from scratch) as a gpt2port checkpoint at `out`;
    `gpt2port export --to hf` then gives transformers a checkpoint that computes the same. A model filled by
    load_into is read the way it was loaded (and carries that checkpoint's tokenizer and provenance); another is
    read as the GPT-2 it is, its head count, activation and LayerNorm eps measured by running a copy of its first
    block. config: what cannot be measured, as a dict ({"n_head": 12, "activation": "gelu"}), a GPTConfig, a size
    name or a checkpoint path. report: the LoadReport of the load that filled it (default: the one load_into
    recorded on the model, `model.gpt2port_load`). Returns the path; its `.report` says what was proven (also in
    manifest.json)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if any(p.is_meta for p in model.parameters()):
        raise GPT2PortError(f"{type(model).__name__}: its parameters are on the meta device (no values): load "
                            f"weights into it first")
    report = loaded(model, report)
    lay, notes = (_loaded_layout(model, report) if report is not None else _own(model, config))
    if lay.reasons:
        raise GPT2PortError(f"{lay.model_name}: cannot be saved as GPT-2: {lay.reasons[0]}")
    undecided = [d for d in lay.decided if d.startswith("undecided")]
    if undecided:
        raise GPT2PortError(f"{lay.model_name}: {undecided[0]}; load it with gpt2port.load_into first, which settles "
                            f"this by running it")
    cfg, state, zeros = canonical_state(model, lay)
    if dtype is None and state[canonical.EMBEDDING].dtype == torch.float64:
        dtype = torch.float32
        notes.append("the class computes in float64; its weights are written as fp32 (a GPT-2 checkpoint holds fp32, "
                     "fp16 or bf16), and the proof below is of that fp32 checkpoint against the class")
    notes = [d for d in lay.decided if d.startswith("n_head=")] + notes
    if zeros:
        notes.append(f"the class has no {', '.join(z.replace('{}', '{i}') for z in zeros)}: saved as zeros (GPT-2 "
                     f"with these biases at zero computes exactly this class)")
    if cfg.activation != "gelu_new":
        notes.append(f"activation: {words(cfg.activation)}, recorded in config.json (activation "
                     f"{cfg.activation!r}; exported to transformers as activation_function {cfg.activation!r})")
    origin = Path(report.source) if report is not None else None
    origin = origin if origin is not None and checkpoint.is_checkpoint(origin) else None
    tok_from = (Path(report.source) if Path(report.source).is_dir() else Path(report.source).parent) \
        if report is not None else None
    out = Path(out)
    if origin is not None and real(out) != real(origin):
        refuse_overlap(out, origin, "the checkpoint the model was loaded from")
    record = {"class": lay.model_name, "activation": cfg.activation,
              "zero_biases": [z.replace("{}", "{i}") for z in zeros]}
    with staged_directory(out, force) as stage:
        inner = checkpoint.save_state(state, cfg, stage / "checkpoint", dtype=dtype, origin=origin,
                                      tokenizer_from=tok_from, kind=f"in-memory {lay.model_name}", record=record)
        rel, tokens = prove(model, lay, inner)
        saved = SaveReport(out, lay.model_name, cfg, rel, tokens, notes)
        _add_proof(inner, saved)
        for f in inner.iterdir():
            os.replace(f, stage / f.name)
        inner.rmdir()
    result = Saved(out)
    result.report = saved
    return result


def prove(model: nn.Module, lay: UserLayout, ckpt: Path) -> tuple[float, int]:
    """(max relative logit difference, tokens) between the class and gpt2port's GPT over the written checkpoint;
    refused when they differ beyond what the dtypes allow."""
    from gpt2port.model import GPT

    ref = GPT.from_pretrained(ckpt, dtype=torch.float32)
    T = context(model, lay)
    ids, L, words = proof_ids(model, lay.config.vocab_size, T)  # the class's whole context, batched and apart
    got, want = run(model, ids), run(ref, ids.cpu())
    got = torch.cat([got[0], got[1, :L], run(model, ids[1:, :L])[0]])
    want = torch.cat([want[0], want[1, :L], want[1, :L]])
    saved_dtype = checkpoint.load_state(ckpt)[2][canonical.EMBEDDING].dtype
    own_dtype = next(model.parameters()).dtype
    tol = max(PROOF_REL.get(saved_dtype, 3e-2), PROOF_REL.get(own_dtype, 3e-2))
    rel = float((got - want).abs().max() / want.abs().max()) if got.shape == want.shape else float("inf")
    if not rel <= tol:
        raise GPT2PortError(f"{lay.model_name}: the checkpoint written from it does not compute it: gpt2port's GPT "
                            f"over it differs from the class by {rel:.3g} (relative, logits on {words}; allowed "
                            f"{tol:g}); nothing was saved. " + _hint(lay))
    return rel, T


def _hint(lay: UserLayout) -> str:
    return (f"It was read as n_head={lay.config.n_head}, activation {lay.config.activation!r}, LayerNorm eps "
            f"{lay.config.layer_norm_epsilon:g}; if one of these is wrong, pass it: save_from(model, out, "
            f"config={{'n_head': ..., 'activation': ...}})")


def _add_proof(ckpt: Path, saved: SaveReport) -> None:
    manifest = checkpoint.read_manifest(ckpt)
    files = records.files_of(manifest)  # the checkpoint's files are as written: their record stays, sealed anew
    entry = manifest["saves"][-1] if manifest.get("saves") else manifest.setdefault("source", {})
    entry["proof"] = {"max_rel": saved.max_rel, "tokens": saved.tokens, "text": saved.proven}
    entry["notes"] = list(saved.notes)
    write_mark(ckpt / checkpoint.MANIFEST, manifest, files)


def _given(config) -> tuple[GPTConfig | None, dict]:
    """(a whole config to read the class as, the facts stated) from save_from's config argument."""
    if isinstance(config, dict):
        known = {f.name for f in dataclasses.fields(GPTConfig)}
        odd = sorted(set(config) - known)
        if odd:
            raise GPT2PortError(f"config: unknown key {odd[0]!r} (GPTConfig's fields: {', '.join(sorted(known))})")
        if config.get("activation", "gelu_new") not in TABLE:
            raise GPT2PortError(f"config: activation {config['activation']!r}: one of {', '.join(TABLE)}")
        return None, dict(config)
    whole = as_config(config)
    return whole, ({k: getattr(whole, k) for k in FACTS} if whole is not None else {})


def _own(model: nn.Module, config) -> tuple[UserLayout, list[str]]:
    """A class no checkpoint was loaded into: read as the GPT-2 it is, its facts measured."""
    whole, given = _given(config)
    if whole is None and set(given) - set(FACTS):  # sizes given as a dict: read the class as that config
        from gpt2port.userclass.roles import read_class

        own = read_class(model, None, run=False)[0].config
        whole = dataclasses.replace(own, **{k: v for k, v in given.items() if k not in FACTS})
    lay, _, missed = own_layout(model, whole, given)
    if lay.reasons or missed is None:
        return lay, []
    why = missed.why
    if missed.closest is not None:  # it runs, and is no GPT-2 block: say what load_into would say of it
        lay.reasons.append(diagnosis(model, missed.closest) or why)
        return lay, []
    # not measurable (block 0 does not run apart): the class's statements and `config` must say it all
    name = lay.model_name
    if "n_head" in lay.unknown and "n_head" not in given:
        raise GPT2PortError(f"{name}: its head count is stated nowhere in the class (no n_head, num_heads or n_heads "
                            f"attribute, no config holding one, no per-head modules) and could not be measured "
                            f"({why}); pass it: save_from(model, out, config={{'n_head': ...}})")
    if "activation" not in given:
        raise GPT2PortError(f"{name}: its MLP's activation could not be measured ({why}); pass it: save_from(model, "
                            f"out, config={{'activation': 'gelu_new'}}) ('gelu_new': GPT-2's tanh GELU, 'gelu': the "
                            f"exact erf GELU, 'relu', 'silu')")
    facts = {k: v for k, v in given.items() if k in FACTS}
    lay.config = dataclasses.replace(lay.config, **facts)
    lay.unknown = []
    return lay, [f"{', '.join(f'{k}={v!r}' for k, v in facts.items())}: as given (config=), proven below"]


def _loaded_layout(model: nn.Module, report) -> tuple[UserLayout, list[str]]:
    """A class filled by load_into: its layout as loaded; the activation (which GPT-2's checkpoint does not say for
    the class) measured as load_into measured it, and with the eps, checked on block 0."""
    lay = dataclasses.replace(report.layout)
    measured = identify(model, lay)
    acts = [measured.name] if measured is not None and measured.name else DISTINCT
    found = measure(model, lay, [lay.config.n_head], acts, eps_hints(model, lay))
    if isinstance(found, Missed):
        if measured is not None and measured.name:
            lay.config = dataclasses.replace(lay.config, activation=measured.name)
        return lay, []
    lay.config = dataclasses.replace(lay.config, activation=found.activation, layer_norm_epsilon=found.eps)
    return lay, []


def diagnosis(model: nn.Module, closest: Found) -> str | None:
    """What load_into's proof names for this class (the first stage that differs, and the known mistake that
    explains it), on the class's own weights read with the closest head count, against GPT-2 itself (tanh GELU,
    eps 1e-5): one diagnosis for both paths. None where that reading computes GPT-2 after all."""
    from gpt2port.userclass.proof import prove as load_proof
    from gpt2port.verification.reference import Float64GPT2
    from gpt2port.verification.reference_canonical import CanonicalFiles

    lay = dataclasses.replace(closest.layout)
    lay.config = dataclasses.replace(lay.config, n_head=closest.n_head, activation="gelu_new",
                                     layer_norm_epsilon=GPTConfig().layer_norm_epsilon)
    try:
        cfg, state, _ = canonical_state(model, lay)
    except GPT2PortError:
        return None
    ref = Float64GPT2(lay.model_name, files=CanonicalFiles(state, cfg.to_hf_config(), lay.model_name))
    proof = load_proof(model, lay, ref)
    return None if proof["passed"] else f"{proof['first_divergence']} (on {proof['words']})"
