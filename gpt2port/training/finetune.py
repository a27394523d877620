"""`gpt2port finetune`: a converted checkpoint, a text dataset, a run directory; out comes a fine-tuned checkpoint.

The run directory DIR holds, while training: tokens/ (the dataset tokenized once, memory-mapped), train_log.jsonl,
train_state/ (what --resume continues from); when done, DIR is also an ordinary gpt2port checkpoint (weights in
fp32, config, tokenizer files, manifest naming the parent and the data) and loss.svg charts the run.
Everything that can be refused is checked before anything is written.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from pathlib import Path

import torch

from gpt2port import records
from gpt2port.checkpoint import MANIFEST, WEIGHTS, is_checkpoint, load_state, read_config, resolve, save_state
from gpt2port.errors import GPT2PortError
from gpt2port.fsio import check_replaceable, refresh_mark, refuse_overlap, refuse_replacing_reads, sweep_leftovers
from gpt2port.lora import train as lora_train
from gpt2port.training import data as tokens
from gpt2port.training import dist, limits, recompute, state
from gpt2port.training.loop import Diverged, Log, Plan, Stopped, Trainer
from gpt2port.training.optim import adamw
from gpt2port.training.saved import SavedRun, read as saved_state

LOG = "train_log.jsonl"
PLOT = "loss.svg"
TOKENS = "tokens"
# What a resumed run must keep: the numbers its arithmetic depends on. World size, accumulation, device and the
# intervals may change (they move sums around, not what is summed).
KEPT = ("steps", "batch_size", "block_size", "lr", "min_lr", "warmup", "weight_decay", "clip", "seed",
        "eval_windows", "dropout", "val_fraction", "dtype",
        "lora", "lora_alpha", "lora_targets", "lora_split_qkv", "lora_dropout", "lora_base_dtype")
# absent from older saved states
ADDED = ("lora", "lora_alpha", "lora_targets", "lora_split_qkv", "lora_dropout", "lora_base_dtype",
         "checkpoint_activations", "sample_every")


class Interrupted(GPT2PortError):
    """The run stopped on request (Ctrl-C, SIGTERM: `signum`, None where another rank was asked) with its state
    saved."""

    def __init__(self, message: str, signum: int | None = None):
        super().__init__(message)
        self.signum = signum


@dataclasses.dataclass
class Settings:
    steps: int = 1000
    batch_size: int = 8
    block_size: int | None = None  # None: the model's context
    lr: float = 3e-5
    min_lr: float | None = None  # None: lr / 10
    warmup: int | None = None  # None: a tenth of the steps, at most 100
    weight_decay: float = 0.1
    clip: float = 1.0
    grad_accum: int = 1
    eval_every: int | None = None  # None: scaled to the run (default_eval_every); 0: none
    eval_windows: int = 32
    save_every: int | None = None  # None: with each evaluation
    sample_every: int = 0  # steps between samples of the model's text printed (nanoGPT's); 0: none
    seed: int = 1337
    dtype: str = "auto"  # auto: bf16 autocast on CUDA, fp32 elsewhere
    dropout: float = 0.0
    val_fraction: float = 0.05
    lora: int | None = None  # LoRA rank: the base frozen, adapters trained (gpt2port/lora); None: every weight
    lora_alpha: float | None = None  # None: the rank (scaling 1)
    lora_targets: str = "qkv"  # of qkv, attn_proj, fc, mlp_proj
    lora_split_qkv: bool = False
    lora_dropout: float = 0.0
    lora_base_dtype: str = "fp32"  # the frozen base's matrices held in fp32 or bf16 (computed in fp32 either way)
    checkpoint_activations: int = 0  # blocks (the first N) recomputed in the backward; -1: all (training/recompute)

    def resolved(self, context: int) -> "Settings":
        s = dataclasses.replace(self)
        s.block_size = context if s.block_size is None else s.block_size
        s.min_lr = s.lr / 10 if s.min_lr is None else s.min_lr
        s.warmup = min(100, s.steps // 10) if s.warmup is None else s.warmup
        s.eval_every = default_eval_every(s.steps, s.batch_size, s.eval_windows) if s.eval_every is None \
            else s.eval_every
        s.save_every = s.eval_every if s.save_every is None else s.save_every
        return s


EVAL_SHARE = 0.1  # of training's work, what the default evaluations may take between the first and the last


def default_eval_every(steps: int, batch_size: int, eval_windows: int) -> int:
    """Evaluations scaled to the run: always before the first step and after the last; between them at most 10
    (every steps // 10, nanoGPT-like, on a long run), and only as many as keep them within EVAL_SHARE of the
    training's work (a step's forward and backward: about 3 forward passes of its batch). A 6-step run of batch 8
    with 32 held-out windows evaluates twice, not seven times."""
    between = int(EVAL_SHARE * steps * 3 * batch_size / max(1, eval_windows))
    return max(1, steps // max(1, min(10, between)))


def _what_may_help(s: Settings) -> str:
    """The option to lower after a divergence: --lora-alpha when it makes the adapters' scaling large (peft's usual
    alpha is 1 to 2 times the rank), else --lr."""
    scaling = (s.lora_alpha or s.lora or 1) / (s.lora or 1)
    if s.lora and scaling > LARGE_SCALING:
        return f"--lora-alpha {s.lora_alpha:g} scales the adapters by {scaling:g}: a lower --lora-alpha may help"
    return "a lower --lr may help"


LARGE_SCALING = 16


def finetune(ckpt, data, out, settings: Settings | None = None, *, device: str | None = None, fsdp: bool = False,
             resume: bool = False, force: bool = False, compile: bool = False, quiet: bool = False,
             given: set[str] | None = None) -> Path:
    """Fine-tune checkpoint `ckpt` on `data` into run directory `out` (see the module docstring); returns `out`.
    Under torchrun every rank calls this. given: the settings named on the command line (a resumed run takes the
    others from its saved state, and refuses a given one that differs)."""
    out = Path(out)
    ckpt_dir = resolve(ckpt)
    config = read_config(ckpt_dir)
    refuse_overlap(out, ckpt_dir, "the checkpoint being fine-tuned")
    if resume and os.path.lexists(out):  # only a run of ours, as it wrote it, is written into (before any of it is
        check_replaceable(out, earlier=True)  # read); one an earlier version began continues
    s = (settings or Settings()).resolved(config.n_positions)
    saved = _check_out(out, resume, force, config)
    if saved is not None:
        named = given if given is not None else (set(vars(s)) if settings is not None else set())
        s = _resumed(s, saved, named)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    s.checkpoint_activations = recompute.resolve(s.checkpoint_activations, config.n_layer, compile)
    _check_settings(s, config.n_positions, world)
    lora_train.check(s, config, fsdp)
    files = tokens.documents(data)  # refuses bad data (one line) before anything is written
    if saved is None:  # a fresh run empties --out first: it must hold neither the data nor the checkpoint
        refuse_replacing_reads(out, [Path(data), *files, ckpt_dir, *ckpt_dir.iterdir()])
    if not resume and os.path.lexists(out):  # --force (_check_out): only a run or checkpoint of ours, as it wrote
        check_replaceable(out)  # it, is removed, every entry at every depth; never through a link (fsio)
    rt = dist.start(device, fsdp)
    try:
        return _run(ckpt_dir, config, data, out, s, rt, saved, compile, quiet)
    finally:
        rt.close()


def _run(ckpt_dir, config, data, out, s: Settings, rt, saved, compile_model, quiet) -> Path:
    if rt.main:
        if saved is None and out.exists():
            shutil.rmtree(out)  # --force: start over (refused earlier without it)
        fresh = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        try:
            cache = tokens.prepare(data, ckpt_dir, out / TOKENS, block_size=s.block_size,
                                   val_fraction=s.val_fraction, quiet=quiet, vocab_size=config.vocab_size)
        except BaseException:
            if fresh:  # the data was refused half-way through (a bad byte deep in a file): leave nothing
                shutil.rmtree(out, ignore_errors=True)
            raise
    rt.barrier()
    if not rt.main:  # rank 0 built the cache; the others find it made from the same files and map it
        cache = tokens.prepare(data, ckpt_dir, out / TOKENS, block_size=s.block_size, val_fraction=s.val_fraction,
                               quiet=True, vocab_size=config.vocab_size)
    train_config = dataclasses.replace(config, dropout=s.dropout)
    _, _, weights = load_state(ckpt_dir)
    model = dist.build(train_config, rt, weights,
                       lambda m, w=None: lora_train.attach(m, s, config, quiet or not rt.main, w),
                       recompute=s.checkpoint_activations)
    del weights
    if s.checkpoint_activations and rt.main and not quiet:
        print(recompute.said(s.checkpoint_activations, config.n_layer), file=sys.stderr)
    optimizer = adamw(model, s.lr, s.weight_decay)
    start = 0
    torch.manual_seed(s.seed + rt.rank)  # dropout's generator; a resumed run restores the saved one
    if saved is not None:
        state.load(saved, rt, model, optimizer)
        start = saved.step
    runner = torch.compile(model) if compile_model else model
    plan = Plan(steps=s.steps, batch_size=s.batch_size, block_size=s.block_size, lr=s.lr, min_lr=s.min_lr,
                warmup=s.warmup, weight_decay=s.weight_decay, clip=s.clip, seed=s.seed,
                eval_windows=s.eval_windows, grad_accum=s.grad_accum, eval_every=s.eval_every,
                save_every=s.save_every, autocast=_autocast(s.dtype, rt.device))
    log = Log(out / LOG, rt.main, start)
    from gpt2port.training.report import Progress

    progress = Progress(s.steps, start, quiet or not rt.main)
    trainer = Trainer(runner, optimizer, rt, plan, cache.train, cache.val, log, progress)
    if s.sample_every:
        from gpt2port.training.sample import sampler

        trainer.sample = sampler(model, ckpt_dir, cache.val, s.seed, s.sample_every, progress)

    saved_at = [start] if saved is not None else []

    def save(done: int) -> None:
        state.save(out, rt, model, optimizer, {"step": done, "settings": dataclasses.asdict(s)})
        saved_at.append(done)

    try:
        trainer.run(start, save)
    except Stopped as e:
        progress.close()
        raise Interrupted(f"{out}: stopped after step {e.step} of {s.steps}; the training state is saved "
                          f"(continue with --resume)", e.signum) from None
    except Diverged as e:
        progress.close()
        kept = f"the state saved at step {saved_at[-1]} is kept" if saved_at else "no training state was saved"
        raise GPT2PortError(f"{out}: training diverged at step {e.step} ({e.what}); nothing of it was written, "
                            f"{kept} ({_what_may_help(s)})") from None
    finally:
        log.close()
    progress.close()
    _finish(out, ckpt_dir, config, model, rt, s, cache, log)
    return out


def _finish(out, ckpt_dir, config, model, rt, s, cache, log) -> None:
    """The fine-tuned weights as a checkpoint in `out` (files moved in one by one, the weights last, so `out`
    reads as a checkpoint only once it is whole), then the plot; the training state is no longer needed."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    taken = lora_train.finish(model, config, s, ckpt_dir) if s.lora else None  # merged in place, checked
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rt.main:
        record = {"finetune": {"data": cache.meta.get("sources", []), "tokens_train": len(cache.train),
                               "settings": dataclasses.asdict(s), "world": rt.world,
                               **({"lora_merge_check": taken["merge_check"]} if taken else {}),
                               "final_loss": next((r["loss"] for r in reversed(log.rows) if "loss" in r), None),
                               "final_eval_loss": next((r["eval_loss"] for r in reversed(log.rows)
                                                        if "eval_loss" in r), None)}}
        stage = out / ".checkpoint"
        shutil.rmtree(stage, ignore_errors=True)
        save_state(full, config, stage, dtype=torch.float32, origin=ckpt_dir, kind="fine-tuned GPT",
                   record=record, extra=(lambda st: lora_train.write(st, out, taken)) if taken else None)
        # The manifest (which records them all) goes in after the other files, the weights last: `out` reads as a
        # checkpoint only once it is whole, and every file moved in is claimed by a manifest at all times.
        for f in sorted(stage.iterdir(), key=lambda f: (f.name == WEIGHTS, f.name == MANIFEST)):
            os.replace(f, out / f.name)
        refresh_mark(out / MANIFEST, via=stage / MANIFEST)  # the moves moved the files' ctimes
        stage.rmdir()
        from gpt2port.training.plot import loss_plot

        with records.recording(out) as chart:
            loss_plot(out / PLOT, [(r["step"], r["loss"]) for r in log.rows if "loss" in r],
                      [(r["step"], r["eval_loss"]) for r in log.rows if "eval_loss" in r],
                      title=f"fine-tuning {ckpt_dir.name}")
        log.record.add(chart.files)
        state.remove(out)
    rt.barrier()


def _autocast(dtype: str, device: torch.device):
    if dtype == "fp32" or (dtype == "auto" and device.type != "cuda"):
        return None
    # bf16 autocast: weights, gradients and optimizer state stay fp32, so no loss scaling is needed (fp16 would).
    return torch.bfloat16


def _check_out(out: Path, resume: bool, force: bool, config) -> SavedRun | None:
    """The saved state to resume from, every file of it checked (None: a fresh run); refuses what would lose a
    user's work."""
    sweep_leftovers(out / TOKENS)  # a run killed while tokenizing left its stage: it blocks nothing
    found = state.where(out) if out.is_dir() else None
    if resume:
        if found is None:
            done = " (it is a finished run)" if out.is_dir() and is_checkpoint(out) else ""
            raise GPT2PortError(f"{out}: no training state to resume from{done}")
        return saved_state(found, log=out / LOG, fields=[f.name for f in dataclasses.fields(Settings)
                                                         if f.name not in ADDED],
                           config=config, model_for=lambda saved: lora_train.meta_model(config, saved, Settings))
    if out.exists() and not out.is_dir():
        raise GPT2PortError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        hint = "--resume to continue it, or " if found is not None else ""
        raise GPT2PortError(f"{out}: already exists (use {hint}--force to start over)")
    return None


def _resumed(s: Settings, saved: SavedRun, given: set[str]) -> Settings:
    """The saved run's settings, with what may change taken from the command line; a kept one given differently
    is refused by name."""
    before = saved.settings
    for name in KEPT:
        if name in given and getattr(s, name) != before.get(name, getattr(Settings, name)):
            raise GPT2PortError(f"--{name.replace('_', '-')} {getattr(s, name)}: the run being resumed used "
                                f"{before[name]} (it must stay the same for the run to continue as it began)")
    keep = {k: before.get(k, getattr(Settings, k)) for k in KEPT}  # a state saved before a setting existed
    changeable = {k: getattr(s, k) if k in given else before.get(k, getattr(Settings, k)) for k in vars(s)
                  if k not in KEPT}
    return dataclasses.replace(s, **keep, **changeable)


def _check_settings(s: Settings, context: int, world: int) -> None:
    limits.check(vars(s))  # every number finite and in range, one line naming the option
    if s.block_size > context:
        raise GPT2PortError(f"--block-size {s.block_size}: must be between 1 and the model's context, {context}")
    if s.batch_size % (world * s.grad_accum):
        raise GPT2PortError(f"--batch-size {s.batch_size}: the global batch must split evenly over {world} "
                            f"process(es) x {s.grad_accum} accumulation step(s)")
