"""`gpt2port verify`: run the converted model and the references on the same inputs, measure, localize, judge.

References:
  float64   gpt2port/reference.py: GPT-2 written out over the raw HF tensors, sharing no code with the converter or
            the model. It is the truth: the errors of both implementations below are measured against it.
  HF        transformers' GPT2LMHeadModel in the same dtype as ours, when transformers is installed: the
            implementation users know, and a cross-check of the float64 reference itself.

Phases, ordered so that at most one model is in memory at a time (gpt2-xl fits a 16 GB machine):
  1. ours: greedy continuation of each prompt through the KV cache; a full forward of every input with the
     residual stream after every block captured.
  2. the float64 reference, streamed block by block. At every stage ours' own sub-module is also run on the
     reference's input ("teacher forcing"), so each stage is judged alone, errors do not pile up across blocks, and
     a failure names the first stage that differs ("block 7: attention output differs").
  3. ours freed; HF loaded in the same dtype: logits of every input, greedy continuation via its own KV cache.

Error measures (all computed in float64):
  max_rel   max|ours - ref| / max|ref| over an input: scale-free, so one tolerance serves every model size
  kl_mean   mean over positions of KL(softmax(ref) || softmax(ours)) in nats
  top1      fraction of positions with the same argmax; a flip is "unexplained" when the reference's own margin
            between the two tokens exceeds twice the tolerated logit error (near-ties may flip in fp16/bf16)
"""

from __future__ import annotations

import gc
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from gpt2port.checkpoint import read_manifest, resolve
from gpt2port.dtypes import DTYPE_LABELS
from gpt2port.config import canonical_name, is_known_name
from gpt2port.errors import GPT2PortError
from gpt2port.reference import WEIGHT_FILES, Float64GPT2, Stage
from gpt2port.verify_report import Check, VerifyReport


@dataclass(frozen=True)
class Tolerance:
    logits_rel: float  # max|Δlogit| / max|ref logit|, end to end and for the KV-cached decode
    kl: float  # mean KL(ref || ours) of next-token distributions, nats
    local_rel: float  # one stage (embeddings, attention, MLP, final norm, head) on the reference's own input
    loss: float  # |loss_ours - loss_ref| on the natural text, nats
    vs_hf_factor: float = 2.0  # ours vs HF: both carry up to one tolerance of error, so allow their sum


# 5-10x the worst error either implementation showed against float64 on random-weight GPT-2s
# (scripts/bench_verify.py; fp32 with 2x1024 random ids, fp16/bf16 with 2x128):
#                      logits max rel   KL        worst stage   KV-cached   loss diff
#     fp32  124M       1.4e-6           1.5e-13   1.4e-6        1.3e-6      1.3e-7
#     fp32  355M       1.5e-6           2.7e-13   1.3e-6        1.3e-6      6.0e-8
#     fp32  774M       2.0e-6           5.0e-13   2.0e-6        1.7e-6      6.1e-8
#     fp32  1.5B       1.9e-6           6.5e-13   1.9e-6        1.6e-6      1.6e-7
#     fp16  124M       1.6e-3           3.1e-7    8.3e-4        1.8e-3      1.8e-4
#     bf16  124M       1.3e-2           2.0e-5    7.2e-3        1.3e-2      3.8e-3
# In fp32 ours (oneDNN's products, see model.Linear) errs about twice as much as HF (8-9e-7: MKL's); on F.linear it
# erred as HF does. fp16/bf16: HF's errors were the same to two digits. KL gets extra room: it grows with the square of
# the logit scale, and real GPT-2 logits (|logit| ~ 100) are larger than random-weight ones. The seeded bugs of
# tests/test_verify.py land at stage errors of 1.7e-4 (erf GELU) to 1.1 (shifted pos_emb).
TOLERANCES = {
    "fp32": Tolerance(logits_rel=1e-5, kl=1e-6, local_rel=1e-5, loss=1e-5),
    "fp16": Tolerance(logits_rel=1.5e-2, kl=1e-3, local_rel=1e-2, loss=5e-3),
    "bf16": Tolerance(logits_rel=1e-1, kl=1e-2, local_rel=5e-2, loss=5e-2),
}

# Natural text of four kinds (prose, facts, fiction, code), 24-29 GPT-2 tokens each. They are cut to a common
# length so that they form one batch: the greedy continuation then costs 20 passes over the weights, not 80.
PROMPTS = (
    "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times.",
    "The Eiffel Tower, completed in 1889 for the World's Fair, stands 330 metres tall and was once the tallest "
    "structure on Earth.",
    "She opened the letter slowly, afraid of what it might say. The first line read: \"Dear Margaret, I am sorry to "
    "tell you that",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
)
PRECISION_ORDER = ["fp32", "fp16", "bf16"]  # finer to coarser
GREEDY_TOKENS = 20
CHUNK = 256  # positions per step when comparing logits: bounds the float64 temporaries at 256 x vocab
RANDOM_BATCH = 2  # > 1, so batching itself is exercised
SEED = 1234
OFFICIAL_HUB = "https://huggingface.co"
# BRIEF §3, from transformers' own test suite: greedy from "The dog" with the real openai-community/gpt2 weights.
KNOWN_ANSWER = {"repo": "gpt2", "prompt": [464, 3290], "new_tokens": 18,
                "expected": [464, 3290, 373, 1043, 287, 257, 2214, 1474, 262, 16246, 286, 2688, 290, 2688, 27262,
                             13, 198, 198, 464, 3290]}


@dataclass
class Input:
    name: str
    kind: str  # "prompt" (natural text + ours' greedy continuation), "known" (known-answer prompt), "random"
    ids: torch.Tensor  # (B, T) int64
    texts: list[str] | None = None
    text_len: int = 0  # leading tokens of each row that are natural text (loss is measured on them)
    prompt_len: int = 0  # tokens before the greedy continuation
    greedy: torch.Tensor | None = None  # (B, n) ours' greedy tokens (KV cache); ids holds all but the last
    step_logits: torch.Tensor | None = None  # (B, n, vocab): ours' KV-cached logits that chose each greedy token

    def greedy_cols(self) -> slice:
        """Positions in ids whose next-token logits chose the greedy tokens."""
        return slice(self.prompt_len - 1, self.prompt_len - 1 + self.greedy.shape[1])


# --- entry points ------------------------------------------------------------------------------------------------

def run_verify(ckpt, reference=None, dtype=None, tokens: int | None = None, progress: bool = False,
               hf: bool = True) -> VerifyReport:
    """Verify a converted checkpoint (directory or NAME) against the HF files it was converted from.

    dtype: compute dtype for ours and HF (default: the checkpoint's). tokens: length of the random-id inputs
    (default: the full context). hf=False skips transformers even when it is installed (float64 reference only).
    """
    from gpt2port.checkpoint import WEIGHTS
    from gpt2port.formats.safetensors import read_header
    from gpt2port.model import GPT

    ckpt_dir = resolve(ckpt)
    manifest = read_manifest(ckpt_dir)
    ref_path = Path(reference) if reference is not None else _manifest_reference(ckpt_dir, manifest)
    source = manifest.get("source", {})
    repo = str(source.get("repo", ""))
    # The known answer holds for the real weights only: the official repo, fetched from the real Hub (a stand-in
    # Hub serves random weights under the same name).
    known = (is_known_name(repo) and canonical_name(repo) == KNOWN_ANSWER["repo"]
             and str(source.get("endpoint", OFFICIAL_HUB)).rstrip("/") == OFFICIAL_HUB)
    stored = read_header(ckpt_dir / WEIGHTS).entries
    weights_dtype = stored["tok_emb.weight"].dtype if "tok_emb.weight" in stored else None
    return _verify(lambda: GPT.from_pretrained(ckpt_dir, dtype=dtype), str(ckpt_dir), ref_path,
                   tokenizer_dirs=[ckpt_dir, ref_path], tokens=tokens, progress=progress, known_answer=known,
                   use_hf=hf, weights_dtype=weights_dtype)


def verify_model(model, reference, tokens: int | None = None, progress: bool = False, known_answer: bool = False,
                 tokenizer_dir=None, hf: bool = True) -> VerifyReport:
    """Verify an in-memory gpt2port GPT (computing in whatever dtype it has) against an HF checkpoint."""
    ref_path = Path(reference)
    dirs = [Path(tokenizer_dir)] if tokenizer_dir else []
    return _verify(lambda: model, "<in-memory model>", ref_path, tokenizer_dirs=dirs + [ref_path], tokens=tokens,
                   progress=progress, known_answer=known_answer, use_hf=hf)


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

def _verify(load_ours: Callable, label: str, ref_path: Path, tokenizer_dirs: list[Path], tokens: int | None,
            progress: bool, known_answer: bool, use_hf: bool = True, weights_dtype=None) -> VerifyReport:
    say = _Progress(progress)
    try:
        return _run(load_ours, label, ref_path, tokenizer_dirs, tokens, known_answer, use_hf, weights_dtype, say)
    finally:
        say(None)  # clear the progress line, also on errors and Ctrl-C


def _run(load_ours, label, ref_path, tokenizer_dirs, tokens, known_answer, use_hf, weights_dtype, say) -> VerifyReport:
    t_start = time.perf_counter()
    say("loading the checkpoint and the reference")
    ref = Float64GPT2(ref_path)
    model = load_ours()
    first_param = next(model.parameters())
    if first_param.device.type != "cpu":
        raise GPT2PortError(f"{label}: verify runs on the CPU (the float64 reference does); move the model there first")
    dt = first_param.dtype
    del first_param  # one parameter would keep the whole memory-mapped checkpoint alive after `del model`
    dlabel = DTYPE_LABELS.get(dt)
    if dlabel is None:
        raise GPT2PortError(f"{label}: parameters are {dt}; verify handles fp32, fp16 and bf16")
    wlabel = DTYPE_LABELS.get(weights_dtype or dt, dlabel)
    # Weights rounded to fp16/bf16 by the conversion stay rounded when computed in fp32: judge by the coarser one.
    tol = TOLERANCES[max(dlabel, wlabel, key=PRECISION_ORDER.index)]
    cfg = model.config
    report = VerifyReport(
        checkpoint=label,
        reference={"path": str(ref_path), "float64": True, "hf": False, "hf_version": None, "hf_note": None},
        dtype=dlabel,
        weights_dtype=wlabel,
        model={"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd, "n_positions": cfg.n_positions,
               "vocab_size": cfg.vocab_size, "n_params": model.num_params()},
        tolerances=asdict(tol),
        timings={"ours": None, "reference": None, "hf": None, "total": None},  # seconds; None: phase not run
    )
    if dlabel != "fp32":
        report.notes.append(f"{dlabel} matrix products are slow on CPUs without native {dlabel} support; "
                            f"--dtype fp32 checks the same {wlabel} weights, judged at {wlabel} tolerances, much faster")
    shape_problem = _shape_mismatch(cfg, ref.config)
    if shape_problem:
        report.metrics = {"overall": {"ours_vs_f64": None, "hf_vs_f64": None, "ours_vs_hf": None}, "per_input": {}}
        report.checks.append(Check("config matches the reference", False, detail=shape_problem))
        report.timings["total"] = time.perf_counter() - t_start
        return report

    # 1. ours
    t0 = time.perf_counter()
    inputs = _make_inputs(model, tokenizer_dirs, tokens, known_answer, report.notes, say)
    ours_logits, streams = [], []
    for k, inp in enumerate(inputs):
        logits, stream = _ours_forward(model, inp.ids, lambda i: say(f"ours: forward {k + 1}/{len(inputs)}, "
                                                                        f"block {i}/{cfg.n_layer}"))
        ours_logits.append(logits)
        streams.append(stream)
    report.inputs = [{"name": i.name, "kind": i.kind, "shape": list(i.ids.shape), "texts": i.texts} for i in inputs]
    report.timings["ours"] = time.perf_counter() - t0

    # 2. float64 reference, with ours' stages teacher-forced alongside
    t0 = time.perf_counter()
    local = _Localizer(model, inputs, streams, tol.local_rel)
    with torch.no_grad():
        ref_logits = ref.forward([i.ids for i in inputs], observe=local.observe,
                                 progress=lambda d, n: say(f"float64 reference: block {d}/{n}"))
    local.head(ref_logits)
    ref.close()
    local.streams = streams = None  # the captured residual streams (0.6 GB at gpt2-xl) are not needed past here
    per_input = {}
    for inp, ours, r in zip(inputs, ours_logits, ref_logits):
        per_input[inp.name] = {"ours_vs_f64": compare_logits(ours, r, tol.logits_rel)}
    report.timings["reference"] = time.perf_counter() - t0
    report.localization = local.result()
    del model, local  # a model loaded here is freed before HF loads; an in-memory caller still holds theirs
    gc.collect()

    # 3. HF transformers, same dtype
    t0 = time.perf_counter()
    hf = _hf_phase(ref_path, dt, inputs, ref_logits, ours_logits, tol, report, say) if use_hf else None
    if not use_hf:
        report.reference["hf_note"] = "skipped on request"
    for inp in inputs:
        per_input[inp.name].update(hf["compare"][inp.name] if hf else {"hf_vs_f64": None, "ours_vs_hf": None})
    report.timings["hf"] = time.perf_counter() - t0 if use_hf else None

    _prompt_metrics(inputs, ours_logits, ref_logits, hf, per_input, tol)
    report.metrics = {"overall": _overall(inputs, per_input), "per_input": per_input}
    report.checks = _judge(report, inputs, per_input, tol, known_answer)
    report.timings["total"] = time.perf_counter() - t_start
    return report


def _shape_mismatch(cfg, rc) -> str | None:
    pairs = [("n_layer", cfg.n_layer, rc.n_layer), ("n_head", cfg.n_head, rc.n_head),
             ("n_embd", cfg.n_embd, rc.n_embd), ("n_positions", cfg.n_positions, rc.n_positions),
             ("vocab_size", cfg.vocab_size, rc.vocab_size)]
    diff = [f"{name} {ours} vs reference {theirs}" for name, ours, theirs in pairs if ours != theirs]
    return "; ".join(diff) or None


# --- inputs and ours ---------------------------------------------------------------------------------------------

def _make_inputs(model, tokenizer_dirs, tokens, known_answer, notes, say) -> list[Input]:
    cfg = model.config
    n_new = min(GREEDY_TOKENS, cfg.n_positions // 2)
    gen = torch.Generator().manual_seed(SEED)
    enc = _tokenizer(tokenizer_dirs, notes)
    encoded = [enc.encode(t) for t in PROMPTS] if enc is not None else []
    if encoded and max(max(ids) for ids in encoded) < cfg.vocab_size:
        length = min(min(len(ids) for ids in encoded), cfg.n_positions - n_new)
        prompt, texts = torch.tensor([ids[:length] for ids in encoded]), list(PROMPTS)
    else:
        notes.append("no natural-text prompts: greedy continuations start from random ids, no loss measured")
        prompt, texts = torch.randint(cfg.vocab_size, (2, 8), generator=gen), None
    inputs = [_greedy_input(model, "prompts", "prompt", prompt, n_new, texts, say)]
    if known_answer:
        inputs.append(_greedy_input(model, "known answer", "known", torch.tensor([KNOWN_ANSWER["prompt"]]),
                                    KNOWN_ANSWER["new_tokens"], ["The dog"], say))
    length = min(tokens or cfg.n_positions, cfg.n_positions)
    if length < 2:
        raise GPT2PortError(f"--tokens {tokens}: need at least 2 tokens")
    if length < cfg.n_positions:
        notes.append(f"random ids cover {length} of {cfg.n_positions} positions (--tokens)")
    inputs.append(Input(f"random {RANDOM_BATCH}x{length}", "random",
                        torch.randint(cfg.vocab_size, (RANDOM_BATCH, length), generator=gen)))
    return inputs


def _tokenizer(dirs: list[Path], notes: list[str]):
    from gpt2port.tokenizer import from_directory as load_tokenizer

    problems = []
    for d in dirs:
        try:
            return load_tokenizer(d if d.is_dir() else d.parent)
        except GPT2PortError as e:
            problems.append(str(e))
    notes.append(f"no usable tokenizer ({'; '.join(problems)})")
    return None


@torch.no_grad()
def _greedy_input(model, name, kind, prompt: torch.Tensor, n_new: int, texts, say) -> Input:
    """Ours' greedy continuation of a (B, T) prompt batch through the KV cache, keeping every step's logits."""
    from gpt2port.model import KVCache

    say(f"ours: greedy continuation of the {name}")
    B, T = prompt.shape
    cache = KVCache(model.config, B, max_len=T + n_new, dtype=next(model.parameters()).dtype)
    logits = model(prompt, cache=cache, last_only=True)[:, -1]
    chosen, steps = [], []
    for _ in range(n_new):
        steps.append(logits)
        chosen.append(logits.argmax(-1))
        if len(chosen) < n_new:
            logits = model(chosen[-1][:, None], cache=cache, last_only=True)[:, -1]
    greedy = torch.stack(chosen, dim=1)
    return Input(name, kind, torch.cat([prompt, greedy[:, :-1]], dim=1), texts=texts,
                 text_len=T if texts and kind == "prompt" else 0, prompt_len=T, greedy=greedy,
                 step_logits=torch.stack(steps, dim=1))


@torch.no_grad()
def _ours_forward(model, ids: torch.Tensor, tick=lambda i: None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """model(ids) as users call it, with the embeddings and the residual stream after each block captured."""
    stream: list[torch.Tensor] = []

    def keep(mod, args, out):
        stream.append(out.detach())
        tick(len(stream) - 1)

    hooks = [model.blocks[0].register_forward_pre_hook(lambda mod, args: stream.append(args[0].detach()))]
    hooks += [b.register_forward_hook(keep) for b in model.blocks]
    try:
        logits = model(ids)
    finally:
        for h in hooks:
            h.remove()
    return logits, stream


class _Localizer:
    """Runs ours' stages on the reference's own inputs as the reference streams past, and records every error."""

    def __init__(self, model, inputs: list[Input], streams, tol: float):
        self.model, self.inputs, self.streams, self.tol = model, inputs, streams, tol
        self.dt = next(model.parameters()).dtype
        self.stages: list[dict] = []
        self.stream: list[dict] = []
        self.finals: list[torch.Tensor] = []

    def _record(self, stage: str, block, part, pairs) -> None:
        self._store(stage, block, part, *_max_errors(pairs))

    def _store(self, stage: str, block, part, max_abs: float, rel: float) -> None:
        self.stages.append({"stage": stage, "block": block, "part": part, "max_abs": max_abs, "rel": rel,
                            "tolerance": self.tol, "passed": bool(rel <= self.tol)})

    def _drift(self, block, index: int, refs) -> None:
        max_abs, rel = _max_errors([(s[index], r) for s, r in zip(self.streams, refs)])
        self.stream.append({"block": block, "max_abs": max_abs, "rel": rel})

    @torch.no_grad()
    def observe(self, st: Stage) -> None:
        m, v, dt = self.model, st.values, self.dt
        if st.kind == "embeddings":
            self._record("embeddings", None, "embeddings",
                         [(m.embed(i.ids), r) for i, r in zip(self.inputs, v["out"])])
            self._drift(None, 0, v["out"])
        elif st.kind == "block":
            b = m.blocks[st.layer]
            self._record(f"block {st.layer} attention", st.layer, "attention",
                         [(b.attn(b.ln1(x.to(dt))), r) for x, r in zip(v["in"], v["attn"])])
            self._record(f"block {st.layer} MLP", st.layer, "mlp",
                         [(b.mlp(b.ln2(x.to(dt))), r) for x, r in zip(v["mid"], v["mlp"])])
            self._drift(st.layer, st.layer + 1, v["out"])
        else:
            self._record("final norm", None, "final_norm",
                         [(m.final_norm(x.to(dt)), r) for x, r in zip(v["in"], v["out"])])
            self.finals = v["out"]

    @torch.no_grad()
    def head(self, ref_logits: list[torch.Tensor]) -> None:
        def chunks(f, r):  # row chunks: ours' head output never exists at full (B, T, vocab) size
            f, r = f.reshape(-1, f.shape[-1]), r.reshape(-1, r.shape[-1])
            for s in range(0, len(f), CHUNK):
                yield self.model.lm_head(f[s:s + CHUNK].to(self.dt)), r[s:s + CHUNK]

        max_abs, rel = 0.0, 0.0
        for f, r in zip(self.finals, ref_logits):
            d = max(_max_errors([pair])[0] for pair in chunks(f, r))
            max_abs, rel = max(max_abs, d), max(rel, _ratio(d, _absmax(r)))
        self._store("head", None, "head", max_abs, rel)
        self.finals = []

    def result(self) -> dict:
        first = next((s for s in self.stages if not s["passed"]), None)
        return {"first_divergence": _divergence_message(first) if first else None,
                "stages": self.stages, "stream": self.stream}


_PART_WORDS = {"embeddings": "embeddings differ", "attention": "attention output differs",
               "mlp": "MLP output differs", "final_norm": "final LayerNorm output differs",
               "head": "head (lm_head) output differs"}


def _divergence_message(s: dict) -> str:
    where = f"block {s['block']}: " if s["block"] is not None else ""
    return f"{where}{_PART_WORDS[s['part']]} (rel {s['rel']:.2e} > {s['tolerance']:.2g})"


def _num(x) -> float:
    """A tensor scalar as float, NaN as +inf: max() would silently skip a NaN, and a NaN must fail every check."""
    x = float(x)
    return math.inf if math.isnan(x) else x


def _absmax(t: torch.Tensor) -> float:
    return max(_num(t.max()), -float(t.min()))  # max|t| without a full-size temporary


def _max_errors(pairs) -> tuple[float, float]:
    """(max|ours - ref| over all pairs, max over pairs of max|ours - ref| / max|ref|), in float64."""
    max_abs, rel = 0.0, 0.0
    for ours, ref in pairs:
        o, r = ours.reshape(-1, ours.shape[-1]), ref.reshape(-1, ref.shape[-1])
        d = max(_num((o[s:s + CHUNK].to(torch.float64) - r[s:s + CHUNK]).abs().max())
                for s in range(0, r.shape[0], CHUNK))
        max_abs, rel = max(max_abs, d), max(rel, _ratio(d, _absmax(r)))
    return max_abs, rel


def _ratio(d: float, scale: float) -> float:
    return d / scale if scale > 0 else (0.0 if d == 0 else float("inf"))


# --- comparisons -------------------------------------------------------------------------------------------------

def compare_logits(ours: torch.Tensor, ref: torch.Tensor, tol_rel: float) -> dict:
    """Error of `ours` against `ref` over every position of one input (see the module docstring)."""
    o_all, r_all = ours.reshape(-1, ours.shape[-1]), ref.reshape(-1, ref.shape[-1])
    scale = _absmax(r_all)
    allow = 2 * tol_rel * scale
    n = r_all.shape[0]
    max_abs = kl = 0.0
    agree = unexplained = top5 = 0
    for s in range(0, n, CHUNK):
        o, r = o_all[s:s + CHUNK].to(torch.float64), r_all[s:s + CHUNK].to(torch.float64)
        max_abs = max(max_abs, _num((o - r).abs().max()))
        logp, logq = F.log_softmax(r, dim=-1), F.log_softmax(o, dim=-1)
        kl += _num((logp.exp() * (logp - logq)).sum().clamp_min(0))  # >= 0 in exact arithmetic
        r_top, o_top = r.argmax(-1), o.argmax(-1)
        agree += int((r_top == o_top).sum())
        margin = r.gather(1, r_top[:, None]) - r.gather(1, o_top[:, None])
        unexplained += int((margin > allow).sum())
        r5, o5 = r.topk(5, dim=-1).indices, o.topk(5, dim=-1).indices
        top5 += int((r5[:, :, None] == o5[:, None, :]).any(-1).sum())
    return {"positions": n, "max_abs": max_abs, "max_rel": _ratio(max_abs, scale),
            "kl_mean": kl / n, "top1": agree / n, "top1_unexplained": unexplained, "top5": top5 / (5 * n),
            "scale": scale}


def _loss(logits: torch.Tensor, ids: torch.Tensor, n: int) -> float:
    """Mean next-token cross-entropy over the first n tokens of every row, in float64."""
    return float(F.cross_entropy(logits[:, : n - 1].flatten(0, 1).to(torch.float64), ids[:, 1:n].flatten()))


def _greedy_vs_ref(inp: Input, ref: torch.Tensor, allow: float) -> dict:
    """Did every greedy step pick the reference's top token (a near-tie within `allow` may go either way)?"""
    rows = ref[:, inp.greedy_cols()]
    best = rows.argmax(-1)
    margin = rows.gather(-1, best[..., None])[..., 0] - rows.gather(-1, inp.greedy[..., None])[..., 0]
    return {"steps": inp.greedy.numel(), "match_f64": int((best == inp.greedy).sum()),
            "unexplained": int((margin > allow).sum()), "ours_tokens": inp.greedy.tolist()}


def _prompt_metrics(inputs, ours_logits, ref_logits, hf, per_input, tol) -> None:
    for k, inp in enumerate(inputs):
        if inp.greedy is None:
            continue
        entry = per_input[inp.name]
        r = ref_logits[k]
        scale = _absmax(r)
        allow = 2 * tol.logits_rel * scale
        g = _greedy_vs_ref(inp, r, allow)
        cached_abs = _num((inp.step_logits.to(torch.float64) - r[:, inp.greedy_cols()]).abs().max())
        g["cached_max_rel"] = _ratio(cached_abs, scale)
        if hf is not None:
            g.update(_greedy_vs_hf(inp, hf["greedy"][inp.name], r, allow))
        entry["greedy"] = g
        if inp.kind == "known":
            entry["known_answer"] = _known_vs_expected(inp, r, allow)
        if inp.text_len >= 2:
            entry["loss"] = {"ours": _loss(ours_logits[k], inp.ids, inp.text_len),
                             "f64": _loss(r, inp.ids, inp.text_len),
                             "hf": hf["loss"][inp.name] if hf is not None else None}


def _first_split(a: list[int], b: list[int]) -> int | None:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _greedy_vs_hf(inp: Input, hf_tokens: torch.Tensor, ref: torch.Tensor, allow: float) -> dict:
    """How far HF's own greedy run (its KV cache) agrees with ours, row by row; a split is explained by a near-tie."""
    same, explained = 0, True
    for b, (ours, theirs) in enumerate(zip(inp.greedy.tolist(), hf_tokens.tolist())):
        split = _first_split(ours, theirs)
        same += len(ours) if split is None else split
        if split is not None:
            # Up to the split both rows are equal, so the reference's logits on ours' row judge HF's token too.
            row = ref[b, inp.prompt_len - 1 + split]
            explained &= bool(abs(float(row[ours[split]] - row[theirs[split]])) <= allow)
    return {"hf_tokens": hf_tokens.tolist(), "match_hf": same, "hf_split_explained": explained}


def _overall(inputs, per_input) -> dict:
    out = {}
    for key in ("ours_vs_f64", "hf_vs_f64", "ours_vs_hf"):
        rows = [per_input[i.name].get(key) for i in inputs]
        if any(r is None for r in rows):
            out[key] = None
            continue
        n = sum(r["positions"] for r in rows)
        out[key] = {"positions": n,
                    "max_abs": max(r["max_abs"] for r in rows),
                    "max_rel": max(r["max_rel"] for r in rows),
                    "kl_mean": sum(r["kl_mean"] * r["positions"] for r in rows) / n,
                    "top1": sum(r["top1"] * r["positions"] for r in rows) / n,
                    "top1_unexplained": sum(r["top1_unexplained"] for r in rows),
                    "top5": sum(r["top5"] * r["positions"] for r in rows) / n}
    greedy = [per_input[i.name]["greedy"] for i in inputs if "greedy" in per_input[i.name]]
    if greedy:
        with_hf = all("match_hf" in g for g in greedy)
        out["greedy"] = {"steps": sum(g["steps"] for g in greedy),
                         "match_f64": sum(g["match_f64"] for g in greedy),
                         "unexplained": sum(g["unexplained"] for g in greedy),
                         "cached_max_rel": max(g["cached_max_rel"] for g in greedy),
                         "match_hf": sum(g["match_hf"] for g in greedy) if with_hf else None}
    losses = [per_input[i.name]["loss"] for i in inputs if "loss" in per_input[i.name]]
    if losses:
        hf_loss = [x["hf"] for x in losses]
        out["loss"] = {"ours": sum(x["ours"] for x in losses) / len(losses),
                       "f64": sum(x["f64"] for x in losses) / len(losses),
                       "hf": None if None in hf_loss else sum(hf_loss) / len(hf_loss),
                       "max_diff": max(abs(x["ours"] - x["f64"]) for x in losses)}
    return out


# --- HF transformers ---------------------------------------------------------------------------------------------

HF_WEIGHT_NAMES = set(WEIGHT_FILES)  # the names transformers loads, in the reference's own list


def _load_hf(ref_path: Path, dt: torch.dtype, report: VerifyReport):
    try:
        import transformers
    except ImportError:
        report.reference["hf_note"] = "transformers is not installed (pip install 'gpt2port[reference]')"
        return None
    if ref_path.is_file() and ref_path.name not in HF_WEIGHT_NAMES:
        report.reference["hf_note"] = f"{ref_path.name} is not a file name transformers loads"
        return None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    directory = ref_path if ref_path.is_dir() else ref_path.parent
    try:
        model = transformers.GPT2LMHeadModel.from_pretrained(directory, local_files_only=True, **{dtype_kw: dt})
    except Exception as e:  # noqa: BLE001 - the float64 reference still stands; say why HF could not join
        report.reference["hf_note"] = f"transformers could not load {directory}: {str(e).splitlines()[0][:200]}"
        return None
    report.reference.update(hf=True, hf_version=transformers.__version__)
    return model.eval()


@torch.no_grad()
def _hf_phase(ref_path, dt, inputs, ref_logits, ours_logits, tol, report, say) -> dict | None:
    say("HF transformers: loading")
    hf = _load_hf(ref_path, dt, report)
    if hf is None:
        report.notes.append(f"HF reference skipped: {report.reference['hf_note']}")
        return None
    compare: dict = {}
    out = {"greedy": {}, "loss": {}, "compare": compare}
    for k, inp in enumerate(inputs):
        say(f"HF transformers: forward {k + 1}/{len(inputs)}")
        logits = hf(inp.ids).logits
        compare[inp.name] = {"hf_vs_f64": compare_logits(logits, ref_logits[k], tol.logits_rel),
                             "ours_vs_hf": compare_logits(ours_logits[k], logits, tol.logits_rel * tol.vs_hf_factor)}
        if inp.text_len >= 2:
            out["loss"][inp.name] = _loss(logits, inp.ids, inp.text_len)
        if inp.greedy is not None:
            out["greedy"][inp.name] = _hf_greedy(hf, inp.ids[:, : inp.prompt_len], inp.greedy.shape[1])
        del logits
    del hf
    gc.collect()
    return out


def _hf_greedy(hf, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding through HF's own KV cache (past_key_values), free of any generation_config settings."""
    out = hf(prompt, use_cache=True)
    chosen = [out.logits[:, -1].argmax(-1)]
    while len(chosen) < n:
        out = hf(chosen[-1][:, None], past_key_values=out.past_key_values, use_cache=True)
        chosen.append(out.logits[:, -1].argmax(-1))
    return torch.stack(chosen, dim=1)


# --- the verdict -------------------------------------------------------------------------------------------------

def _judge(report: VerifyReport, inputs, per_input, tol: Tolerance, known_answer: bool) -> list[Check]:
    checks: list[Check] = []
    loc = report.localization
    stages = loc["stages"]
    first = next((s for s in stages if not s["passed"]), None)
    worst = max(stages, key=lambda s: s["rel"])
    checks.append(Check("every stage in isolation", first is None, worst["rel"], tol.local_rel,
                        loc["first_divergence"] or f"worst: {worst['stage']}"))
    o = report.metrics["overall"]["ours_vs_f64"]
    checks.append(Check("logits vs float64 (max rel)", o["max_rel"] <= tol.logits_rel, o["max_rel"], tol.logits_rel,
                        "" if o["max_rel"] <= tol.logits_rel or first else
                        "every stage matches alone: forward() wires them differently"))
    checks.append(Check("next-token KL vs float64", o["kl_mean"] <= tol.kl, o["kl_mean"], tol.kl))
    checks.append(Check("top-1 flips beyond near-ties", o["top1_unexplained"] == 0, o["top1_unexplained"], 0,
                        f"top-1 agreement {100 * o['top1']:.2f}%"))
    g = report.metrics["overall"].get("greedy")
    if g:
        checks.append(Check("KV-cached decode vs float64", g["cached_max_rel"] <= tol.logits_rel,
                            g["cached_max_rel"], tol.logits_rel, "logits of each greedy step"))
        checks.append(Check("greedy tokens = float64 top-1", g["unexplained"] == 0, f"{g['match_f64']}/{g['steps']}",
                            None, f"{g['unexplained']} steps off beyond a near-tie" if g["unexplained"] else ""))
    loss = report.metrics["overall"].get("loss")
    if loss:
        checks.append(Check("loss on natural text vs float64", loss["max_diff"] <= tol.loss, loss["max_diff"],
                            tol.loss, f"ours {loss['ours']:.4f}, float64 {loss['f64']:.4f} nats"))
    if report.reference.get("hf"):
        h, oh = report.metrics["overall"]["hf_vs_f64"], report.metrics["overall"]["ours_vs_hf"]
        checks.append(Check("HF vs float64 (references agree)", h["max_rel"] <= tol.logits_rel, h["max_rel"],
                            tol.logits_rel, "" if h["max_rel"] <= tol.logits_rel else
                            "the two references disagree: check the HF config/files"))
        vs_hf = tol.logits_rel * tol.vs_hf_factor
        checks.append(Check("logits vs HF (max rel)", oh["max_rel"] <= vs_hf, oh["max_rel"], vs_hf))
        if g:
            splits = [i.name for i in inputs if "greedy" in per_input[i.name]
                      and not per_input[i.name]["greedy"]["hf_split_explained"]]
            checks.append(Check("greedy tokens = HF's (own KV cache)", not splits, f"{g['match_hf']}/{g['steps']}", None,
                                f"split beyond a near-tie in {', '.join(splits)}" if splits else ""))
    if known_answer:
        checks.append(_known_answer_check(inputs, per_input))
    return checks


def _known_vs_expected(inp: Input, ref: torch.Tensor, allow: float) -> dict:
    got = inp.greedy[0].tolist()
    expected = KNOWN_ANSWER["expected"][inp.prompt_len:]
    split = _first_split(got, expected)
    if split is None:
        return {"match": True, "split": None, "explained": True, "tokens": got}
    # Up to the split ours equals the expected sequence, so the reference's logits there judge the two tokens.
    row = ref[0, inp.prompt_len - 1 + split]
    explained = bool(abs(float(row[got[split]] - row[expected[split]])) <= allow)
    return {"match": False, "split": split, "explained": explained, "tokens": got}


def _known_answer_check(inputs, per_input) -> Check:
    inp = next(i for i in inputs if i.kind == "known")
    k = per_input[inp.name]["known_answer"]
    name = "known answer (greedy from 'The dog')"
    if k["match"]:
        return Check(name, True, "match", detail=f"{len(k['tokens'])} tokens as in transformers' test suite")
    s = k["split"]
    expected = KNOWN_ANSWER["expected"][inp.prompt_len:]
    detail = f"new token {s}: got {k['tokens'][s:s + 3]}..., expected {expected[s:s + 3]}..."
    if k["explained"]:
        return Check(name, True, "near-tie split", detail=detail + " (a near-tie at this precision)")
    return Check(name, False, "mismatch", detail=detail)


class _Progress:
    """One self-overwriting status line on stderr, only when asked for and stderr is a terminal."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self.shown = False
        self.t0 = time.perf_counter()

    def __call__(self, message: str | None) -> None:
        if not self.enabled:
            return
        if message is None:
            if self.shown:
                sys.stderr.write("\r\033[K")
            self.shown = False
        else:
            sys.stderr.write(f"\r\033[Kverify [{time.perf_counter() - self.t0:5.0f}s] {message}")
            self.shown = True
        sys.stderr.flush()
