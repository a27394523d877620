"""The training loop: one optimizer step over the global batch, evaluation on fixed held-out windows, the log, and
stopping cleanly on Ctrl-C or SIGTERM.

World-size independence: step s's global batch is drawn from (seed, s) alone (training/data.py); rank r takes its
contiguous share and splits it into grad_accum micro-batches. Every micro-batch holds the same number of tokens, so
the mean of the micro losses, averaged over ranks (DDP and FSDP average gradients), is the global batch's mean loss
and its gradient: one process and N processes run the same optimization.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2port import inputs, jsonio
from gpt2port.signals import stop_requests
from gpt2port.errors import GPT2PortError
from gpt2port.training import data as tokens
from gpt2port.records import RunRecord
from gpt2port.training.dist import Runtime
from gpt2port.training.optim import lr_at, set_lr


@dataclass
class Plan:
    """The numbers of a run that decide its arithmetic (what --resume must keep)."""

    steps: int
    batch_size: int
    block_size: int
    lr: float
    min_lr: float
    warmup: int
    weight_decay: float
    clip: float
    seed: int
    eval_windows: int
    grad_accum: int = 1
    eval_every: int = 0
    save_every: int = 0
    autocast: torch.dtype | None = None


class Diverged(Exception):
    """A non-finite loss, gradient or weight at step `step`: nothing of that step is kept."""

    def __init__(self, step: int, what: str):
        super().__init__(f"step {step}: {what}")
        self.step, self.what = step, what


class Stopped(Exception):
    """Training stopped on request after `step` steps; its state was saved. `signum`: the signal that asked (None
    where another rank was asked)."""

    def __init__(self, step: int, signum: int | None = None):
        super().__init__(f"stopped after step {step}")
        self.step, self.signum = step, signum


class Log:
    """train_log.jsonl, written by rank 0 alone: one object per step, one per evaluation."""

    def __init__(self, path: Path, main: bool, done: int):
        self.path, self.main = path, main
        if main:
            self.rows = read_rows(path, done)
            self.record = RunRecord(path.parent)  # the log's fingerprint, kept a line ahead (records.py)
            self.file = self.record.start_log(path, "".join(json.dumps(r) + "\n" for r in self.rows))

    def write(self, row: dict) -> None:
        if self.main:
            self.rows.append(row)
            line = json.dumps(row) + "\n"
            self.record.append(line)
            self.file.write(line)

    def close(self) -> None:
        if self.main:
            self.file.close()
            self.record.closed()


def read_rows(path: Path, done: int) -> list[dict]:
    """The rows of the steps a resumed run does not repeat: those up to the saved step (a killed run may have
    logged later steps, which will run again). Each line must be a row of this log; a last line without its line
    break is one being written when the run was killed (it comes after the save, and is dropped)."""
    if not path.exists():
        return []
    data = inputs.read_bytes(path, inputs.LIMITS["log"], "a training log")
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GPT2PortError(f"{path}: not a training log (not UTF-8 at byte {e.start})") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row = jsonio.loads(line, f"{path}:{n}", "not a JSON line")
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0 or not all(
                isinstance(row[k], (int, float)) and not isinstance(row[k], bool) for k in ROW_NUMBERS if k in row):
            raise GPT2PortError(f"{path}:{n}: not a row of a training log (an object with a whole \"step\" and "
                                f"numbers)")
        rows.append(row)
    return [r for r in rows if r["step"] <= done]


ROW_NUMBERS = ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s")


class Trainer:
    def __init__(self, model, optimizer, rt: Runtime, plan: Plan, train, val, log: Log, progress):
        self.model, self.opt, self.rt, self.plan = model, optimizer, rt, plan
        self.train, self.val, self.log, self.progress = train, val, log, progress
        per_rank = plan.batch_size // rt.world
        self.micro = per_rank // plan.grad_accum
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.sample = None  # sample(done): called after every step (training/sample.py decides when it speaks)

    def _autocast(self):
        if self.plan.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.rt.device.type, dtype=self.plan.autocast)

    def _sync(self, on: bool):
        """Whether this backward reduces gradients across ranks (only the last micro-batch's needs to)."""
        m = self.model
        if hasattr(m, "set_requires_gradient_sync"):  # fully_shard
            m.set_requires_gradient_sync(on)
            return contextlib.nullcontext()
        if hasattr(m, "no_sync") and not on:  # DDP
            return m.no_sync()
        return contextlib.nullcontext()

    def _batch(self, split, offsets):
        x, y = tokens.windows(split, offsets, self.plan.block_size)
        return x.to(self.rt.device, non_blocking=True), y.to(self.rt.device, non_blocking=True)

    def step(self, step: int) -> dict:
        """Optimizer step `step` (0-based): returns its log row (global mean loss, lr, gradient norm)."""
        p, rt = self.plan, self.rt
        lr = lr_at(step, lr=p.lr, warmup=p.warmup, steps=p.steps, min_lr=p.min_lr)
        set_lr(self.opt, lr)
        offsets = tokens.sample_offsets(len(self.train), p.block_size, seed=p.seed, step=step, count=p.batch_size)
        mine = offsets[rt.rank * self.micro * p.grad_accum : (rt.rank + 1) * self.micro * p.grad_accum]
        self.model.train()
        total = torch.zeros((), dtype=torch.float64, device=rt.device)
        for m in range(p.grad_accum):
            x, y = self._batch(self.train, mine[m * self.micro : (m + 1) * self.micro])
            with self._sync(m == p.grad_accum - 1):
                with self._autocast():
                    _, loss = self.model(x, y)
                (loss / p.grad_accum).backward()
            total += loss.detach().double()
        norm = torch.nn.utils.clip_grad_norm_(self.params, p.clip if p.clip > 0 else math.inf)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        loss = rt.sum([total.item() / p.grad_accum])[0] / rt.world
        if not (math.isfinite(loss) and math.isfinite(float(norm))):  # every rank sees the same reduced numbers
            raise Diverged(step + 1, f"loss {loss}, gradient norm {float(norm)}")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": float(norm)}

    @torch.no_grad()
    def check_weights(self, done: int) -> None:
        """Every weight finite on every rank (a finite loss can still be followed by an update to inf)."""
        bad = any(not bool(torch.isfinite(getattr(w, "_local_tensor", w)).all()) for w in self.params)
        if self.rt.any(bad):
            raise Diverged(done, "a weight is no longer finite after the update")

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed held-out windows, each rank taking every world-th window. Every rank runs the
        same number of forward passes (a sharded forward is collective): one whose windows ran out repeats a
        window with weight 0."""
        p, rt = self.plan, self.rt
        offsets = tokens.eval_offsets(len(self.val), p.block_size, p.eval_windows)
        mine = offsets[rt.rank :: rt.world]
        size = max(1, self.micro)
        rounds = math.ceil(math.ceil(len(offsets) / rt.world) / size)  # the busiest rank's batches
        self.model.eval()
        loss_sum, count = 0.0, 0
        for i in range(rounds):
            part = mine[i * size : (i + 1) * size]
            x, y = self._batch(self.val, part if len(part) else offsets[:1])
            with self._autocast():
                _, loss = self.model(x, y)
            loss_sum += float(loss) * len(part)
            count += len(part)
        loss_sum, count = rt.sum([loss_sum, count])
        return loss_sum / max(count, 1)

    def run(self, start: int, save) -> None:
        """Steps start..steps-1; save(step) is called every save_every steps and when a stop is requested."""
        p, rt = self.plan, self.rt
        tokens_per_step = p.batch_size * p.block_size
        with stop_requests() as stop:
            if start == 0 and p.eval_every:
                self._eval_row(0)
            for step in range(start, p.steps):
                t0 = time.perf_counter()
                row = self.step(step)
                row["tokens_per_s"] = tokens_per_step / (time.perf_counter() - t0)
                self.log.write(row)
                self.progress(row)
                done = step + 1
                if p.eval_every and (done % p.eval_every == 0 or done == p.steps):
                    self._eval_row(done)
                if self.sample is not None:
                    self.sample(done)
                stopping = rt.any(bool(stop.caught))
                saving = stopping or (p.save_every and done % p.save_every == 0)
                if saving or done == p.steps:
                    self.check_weights(done)  # nothing non-finite is saved, nor becomes the checkpoint
                if saving and done < p.steps:
                    save(done)
                if stopping and done < p.steps:
                    raise Stopped(done, stop.caught[0] if stop.caught else None)

    def _eval_row(self, done: int) -> None:
        row = {"step": done, "eval_loss": self.evaluate()}
        if not math.isfinite(row["eval_loss"]):
            raise Diverged(done, f"held-out loss {row['eval_loss']}")
        self.log.write(row)
        self.progress(row)
