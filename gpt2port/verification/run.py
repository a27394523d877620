"""`gpt2port verify`: run the model under test and the references on the same inputs, measure, localize, judge.

References:
  float64   verification/reference.py: GPT-2 written out over the raw HF tensors, sharing no code with the converter
            or the model. It is the truth: the errors of both implementations below are measured against it.
  HF        transformers' GPT2LMHeadModel in the same dtype as ours, when transformers is installed: the
            implementation users know, and a cross-check of the float64 reference itself.

Phases, ordered so that at most one model is in memory at a time (gpt2-xl fits a 16 GB machine):
  1. ours: greedy continuation of each prompt (through the KV cache where the model has one); a full forward of
     every input with the residual stream after every block captured.
  2. the float64 reference, streamed block by block, with ours' stages teacher-forced alongside (localize.py).
  3. ours freed; HF loaded in the same dtype: logits of every input, greedy continuation via its own KV cache.
"""

from __future__ import annotations

import copy
import gc
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from gpt2port.checkpoint import read_manifest, resolve
from gpt2port.dtypes import DTYPE_LABELS
from gpt2port.config import canonical_name, is_known_name
from gpt2port.errors import GPT2PortError
from gpt2port.progress import StatusLine
from gpt2port.verification import history
from gpt2port.verification.diagnose import describe_non_finite, non_finite_parameters
from gpt2port.verification.hf import hf_phase
from gpt2port.verification.inputs import KNOWN_ANSWER, make_inputs
from gpt2port.verification.localize import Localizer
from gpt2port.verification.metrics import compare_logits, overall, prompt_metrics
from gpt2port.verification.reference import Float64GPT2
from gpt2port.verification.report import Check, VerifyReport
from gpt2port.verification.stages import Stages, as_stages
from gpt2port.verification.tolerances import tolerance_for
from gpt2port.verification.verdict import judge

OFFICIAL_HUB = "https://huggingface.co"


# --- entry points ------------------------------------------------------------------------------------------------

def run_verify(ckpt, reference=None, dtype=None, tokens: int | None = None, progress: bool = False,
               hf: bool = True, grads: bool = False) -> VerifyReport:
    """Verify a converted checkpoint (directory or NAME) against the HF files it was converted from.

    reference: the HF directory or weights file (default: the source in the checkpoint's manifest), or a Float64GPT2
    already open, which the caller keeps and closes. dtype: compute dtype for ours and HF (default: the
    checkpoint's). tokens: length of the random-id inputs (default: the full context). hf=False skips transformers
    even when it is installed (float64 reference only). grads: also compare the loss and every parameter's gradient
    with transformers' in fp32 (grads.py), on the random-id input. progress: show each step on stderr (a line that
    redraws itself on a terminal; one plain line per step in a log, a pipe or a notebook).
    """
    from gpt2port.checkpoint import WEIGHTS
    from gpt2port.formats.safetensors import read_header
    from gpt2port.model import GPT

    ckpt_dir = resolve(ckpt)
    manifest = read_manifest(ckpt_dir)
    ref = reference if reference is not None else _manifest_reference(ckpt_dir, manifest)
    source = manifest.get("source", {})
    repo = str(source.get("repo", ""))
    # The known answer holds for the real weights only: the official repo, fetched from the real Hub (a stand-in
    # Hub serves random weights under the same name).
    known = (is_known_name(repo) and canonical_name(repo) == KNOWN_ANSWER["repo"]
             and str(source.get("endpoint", OFFICIAL_HUB)).rstrip("/") == OFFICIAL_HUB)
    stored = read_header(ckpt_dir / WEIGHTS).entries
    weights_dtype = stored["tok_emb.weight"].dtype if "tok_emb.weight" in stored else None
    events = history.from_manifest(manifest)
    report = _verify(lambda: GPT.from_pretrained(ckpt_dir, dtype=dtype), str(ckpt_dir), ref,
                     tokenizer_dirs=[ckpt_dir], tokens=tokens, progress=progress, known_answer=known,
                     use_hf=hf, weights_dtype=weights_dtype,
                     load_for_grads=(lambda: GPT.from_pretrained(ckpt_dir, dtype="fp32")) if grads else None,
                     events=events)
    saves = manifest.get("saves", [])
    if reference is None and saves and not report.passed and not events:
        # The manifest's source is where the weights were converted from; a model saved since (fine-tuned, edited)
        # is not that model, and its "mistakes" are its changes.
        report.notes.append(f"these weights were saved from a model in memory {len(saves)} time(s) since they were "
                            f"converted from {ref} (gpt2port info {ckpt_dir} lists when): if that model was changed "
                            f"(fine-tuned, edited), {ref} is not their reference; pass --reference")
    return report


def verify_model(model, reference, tokens: int | None = None, progress: bool = False, known_answer: bool = False,
                 tokenizer_dir=None, hf: bool = True, grads: bool = False) -> VerifyReport:
    """Verify an in-memory model (computing in whatever dtype it has) against an HF checkpoint.

    model: gpt2port's GPT, or any model behind a Stages adapter (verification/stages.py; a user's own class comes
    through gpt2port.userclass.verify_model, which wraps it). reference: as for run_verify.
    """
    from gpt2port.model import GPT

    if grads and not isinstance(model, GPT):
        raise GPT2PortError(f"{type(model).__name__}: gradient parity is checked for gpt2port's GPT (save_from a "
                            f"class of your own, then verify its checkpoint with grads)")
    load_for_grads = (lambda: copy.deepcopy(model)) if grads else None  # the caller's model is left as it was
    events = []
    if isinstance(model, GPT) and getattr(model, "checkpoint_dir", None) is not None:
        events = history.from_manifest(read_manifest(Path(model.checkpoint_dir)))
    elif isinstance(model, torch.nn.Module) and not isinstance(model, GPT):  # read through gpt2port.userclass
        raise GPT2PortError(f"{type(model).__name__}: not gpt2port's GPT; verify your own class with "
                            f"gpt2port.verify_model, which reads it as load_into filled it")
    dirs = [Path(tokenizer_dir)] if tokenizer_dir else []
    return _verify(lambda: model, "<in-memory model>", reference, tokenizer_dirs=dirs, tokens=tokens,
                   progress=progress, known_answer=known_answer, use_hf=hf, load_for_grads=load_for_grads,
                   events=events)


def _manifest_reference(ckpt_dir: Path, manifest: dict) -> Path:
    src = manifest.get("source", {}).get("path")
    if not src:
        raise GPT2PortError(f"{ckpt_dir / 'manifest.json'}: records no source path; pass --reference SRC "
                            f"(the Hugging Face directory it was converted from)")
    path = Path(src)
    if not path.exists():
        raise GPT2PortError(f"{path}: the source recorded in {ckpt_dir / 'manifest.json'} is gone; "
                            f"pass --reference SRC")
    return path


# --- the run -----------------------------------------------------------------------------------------------------

def _verify(load_ours: Callable, label: str, reference, tokenizer_dirs: list[Path], tokens: int | None,
            progress: bool, known_answer: bool, use_hf: bool = True, weights_dtype=None,
            load_for_grads: Callable | None = None, events=()) -> VerifyReport:
    # a terminal: a line; a log: step lines, and a long step's line again after 9 s (checked every 0.5 s): a log
    # never goes 10 s without a line
    say = StatusLine("verify", quiet=not progress, lines=True, tick=0.5, every=9.0)
    try:
        report = _run(load_ours, label, reference, tokenizer_dirs, tokens, known_answer, use_hf, weights_dtype, say,
                      events)
        if load_for_grads is not None:
            _grads(report, load_for_grads, say, use_hf)
        return report
    finally:
        say(None)  # clear the progress line, also on errors and Ctrl-C


def _grads(report: VerifyReport, load_ours: Callable, say, use_hf: bool = True) -> None:
    """Gradient parity on the random-id input (the last one), appended as one more check: against transformers, or
    with use_hf False against the float64 reference's own gradients."""
    from gpt2port.verification.grads import gradient_parity

    t0 = time.perf_counter()
    random = [i for i in report.inputs if i["kind"] == "random"]
    shape = (random or report.inputs)[-1]["shape"]
    ids = torch.randint(0, report.model["vocab_size"], tuple(shape), generator=torch.Generator().manual_seed(0))
    g = gradient_parity(load_ours, Path(report.reference["path"]), ids, hf=use_hf, say=say)
    report.metrics["grads"] = g
    against = "transformers (fp32)" if g["reference"] == "transformers" else "the float64 reference"
    report.checks.append(Check(f"gradients vs {against}", g["max_rel"] <= g["tolerance"], g["max_rel"],
                               g["tolerance"], f"worst {g['worst']}; loss {g['loss_ours']:.6f} vs "
                                               f"{g['loss_ref']:.6f} over {shape[0]}x{shape[1]} random ids"))
    report.timings["total"] = (report.timings["total"] or 0.0) + time.perf_counter() - t0


def _run(load_ours, label, reference, tokenizer_dirs, tokens, known_answer, use_hf, weights_dtype,
         say, events=()) -> VerifyReport:
    t_start = time.perf_counter()
    say("loading the checkpoint and the reference")
    owned = not hasattr(reference, "forward")  # a path: opened here, closed here
    ref = Float64GPT2(reference) if owned else reference
    ref_path = ref.path
    ours = as_stages(load_ours())
    if events:
        ours.history = (*ours.history, *events)
    if ours.device.type != "cpu":
        raise GPT2PortError(f"{label}: verify runs on the CPU (the float64 reference does); move the model there first")
    dt = ours.dtype  # an int8 model computes around its products in fp32: HF runs in fp32 beside it
    dlabel = ours.precision or DTYPE_LABELS.get(dt)
    if dlabel is None:
        raise GPT2PortError(f"{label}: parameters are {dt}; verify handles fp32, fp16, bf16 and int8")
    wlabel = DTYPE_LABELS.get(weights_dtype or dt, dlabel)
    tol = tolerance_for(dlabel, wlabel)
    report = VerifyReport(
        checkpoint=label,
        reference={"path": str(ref_path), "float64": True, "hf": False, "hf_version": None, "hf_note": None,
                   "hf_dtype": None},
        dtype=dlabel,
        weights_dtype=wlabel,
        model={"n_layer": ours.n_layer, "n_head": ours.n_head, "n_embd": ours.n_embd,
               "n_positions": ours.n_positions, "vocab_size": ours.vocab_size, "n_params": ours.n_params},
        tolerances=asdict(tol),
        timings={"ours": None, "reference": None, "hf": None, "total": None},  # seconds; None: phase not run
    )
    if dlabel in ("fp16", "bf16"):
        report.notes.append(f"{dlabel} matrix products are slow on CPUs without native {dlabel} support; "
                            f"--dtype fp32 checks the same {wlabel} weights, judged at {wlabel} tolerances, "
                            f"much faster")
    report.notes += [f"history: {line}" for line in history.lines(ours.history)]
    shape_problem = _shape_mismatch(ours, ref.config)
    # NaN or Inf weights make every comparison meaningless: they are named, and nothing is compared.
    non_finite = non_finite_parameters(ours.module) if ours.module is not None and not shape_problem else []
    if shape_problem or non_finite:
        report.metrics = {"overall": {"ours_vs_f64": None, "hf_vs_f64": None, "ours_vs_hf": None}, "per_input": {}}
        report.checks.append(Check("config matches the reference", False, detail=shape_problem) if shape_problem else
                             Check("weights are finite", False, detail=describe_non_finite(non_finite, "the model's")))
        report.timings["total"] = time.perf_counter() - t_start
        return report

    # 1. ours
    t0 = time.perf_counter()
    inputs = make_inputs(ours, tokenizer_dirs + [ref_path], tokens, known_answer, report.notes, say)
    ours_logits, streams, n_layer = [], [], ours.n_layer
    for k, inp in enumerate(inputs):
        stream: list[torch.Tensor] = []

        def keep(x, k=k, stream=stream):
            stream.append(x)
            if len(stream) > 1:
                say(f"ours: forward {k + 1}/{len(inputs)}, block {len(stream) - 1}/{n_layer}")

        with torch.no_grad():
            ours_logits.append(ours.logits(inp.ids, keep))
        streams.append(stream)
    report.inputs = [{"name": i.name, "kind": i.kind, "shape": list(i.ids.shape), "texts": i.texts} for i in inputs]
    report.timings["ours"] = time.perf_counter() - t0

    # 2. float64 reference, with ours' stages teacher-forced alongside
    t0 = time.perf_counter()
    local = Localizer(ours, inputs, streams, tol.local_rel, ref)
    with torch.no_grad():
        ref_logits = ref.forward([i.ids for i in inputs], observe=local.observe,
                                 progress=lambda d, n: say(f"float64 reference: block {d}/{n}"))
    local.head(ref_logits)
    if owned:
        ref.close()
    local.streams = streams = None  # the captured residual streams (0.6 GB at gpt2-xl) are not needed past here
    report.localization = local.result()
    kv_cached = ours.kv_cached
    # a model loaded here is freed before the logits are compared (beside both models' logits) and before HF
    # loads; an in-memory caller still holds theirs
    del ours, local
    gc.collect()
    per_input = {}
    for inp, o, r in zip(inputs, ours_logits, ref_logits):
        per_input[inp.name] = {"ours_vs_f64": compare_logits(o, r, tol.logits_rel)}
    report.timings["reference"] = time.perf_counter() - t0

    # 3. HF transformers, same dtype
    t0 = time.perf_counter()
    hf = hf_phase(ref_path, dt, inputs, ref_logits, ours_logits, tol, report, say) if use_hf else None
    if not use_hf:
        report.reference["hf_note"] = "skipped on request"
    for inp in inputs:
        per_input[inp.name].update(hf["compare"][inp.name] if hf else {"hf_vs_f64": None, "ours_vs_hf": None})
    report.timings["hf"] = time.perf_counter() - t0 if use_hf else None

    prompt_metrics(inputs, ours_logits, ref_logits, hf, per_input, tol)
    report.metrics = {"overall": overall(inputs, per_input), "per_input": per_input}
    report.checks = judge(report, inputs, per_input, tol, known_answer, kv_cached)
    report.timings["total"] = time.perf_counter() - t_start
    return report


def _shape_mismatch(ours: Stages, rc) -> str | None:
    names = ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")
    cropped = any(h["event"] == history.CROPPED_POSITIONS and h["rows"] == ours.n_positions
                  and h["of"] == rc.n_positions for h in ours.history)
    names = names if not cropped else tuple(n for n in names if n != "n_positions")  # said in the notes
    pairs = [(n, getattr(ours, n), getattr(rc, n)) for n in names]
    diff = [f"{n} {mine} vs reference {theirs}" for n, mine, theirs in pairs if mine != theirs]
    return "; ".join(diff) or None
