"""What a training run shows while it runs: a progress bar with loss, lr and tokens/s on a terminal; in a log or a
pipe, a plain line every few steps (every step of a short run, and at least one every LINE_SECONDS) and one per
evaluation (no bar garbage); the closing line naming what the run left."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from gpt2port.progress import tqdm_bar

LINE_SECONDS = 10.0


class Progress:
    def __init__(self, steps: int, start: int, quiet: bool, every: int | None = None):
        self.quiet, self.steps = quiet, steps
        self.every = every or max(1, min(10, steps // 10))  # a 6-step run: every step; a long one: every 10
        self.last = time.perf_counter()
        try:  # a terminal that reports no size (some CI ptys) would get a bar of no width: a fixed one instead
            sized = os.get_terminal_size(sys.stderr.fileno()).columns > 0
        except (OSError, ValueError):
            sized = False
        width = {"dynamic_ncols": True} if sized else {"ncols": 100}
        self.bar = tqdm_bar(quiet, total=steps, initial=start, desc="fine-tuning", unit="step", **width)

    def __call__(self, row: dict) -> None:
        if self.quiet:
            return
        if "eval_loss" in row:
            self._line(f"step {row['step']}/{self.steps}: eval loss {row['eval_loss']:.4f}")
            return
        text = f"loss {row['loss']:.4f}  lr {row['lr']:.2e}  {row['tokens_per_s']:,.0f} tok/s"
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif row["step"] % self.every == 0 or row["step"] in (1, self.steps) or \
                time.perf_counter() - self.last >= LINE_SECONDS:
            self._line(f"step {row['step']}/{self.steps}: {text}")

    def sample(self, step: int, text: str) -> None:
        """A sample of the model's text, as nanoGPT prints them while it trains."""
        if not self.quiet:
            self._line(f"step {step}/{self.steps} sample: {text!r}")

    def _line(self, text: str) -> None:
        self.last = time.perf_counter()
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def wrote(out: Path) -> str:
    """The closing line: the run directory and every output in it, with what each is for."""
    from gpt2port.lora.train import ADAPTER

    parts = ["the fine-tuned checkpoint (gpt2port generate/export/verify it)", "train_log.jsonl", "loss.svg"]
    if (Path(out) / ADAPTER).is_dir():
        parts.append(f"{ADAPTER}/ (the LoRA adapter in peft's format: gpt2port merge BASE {Path(out) / ADAPTER})")
    return f"wrote {out}: " + ", ".join(parts)
