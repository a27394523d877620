"""What a training run shows while it runs: a progress bar with loss, lr and tokens/s on a terminal; in a log or a
pipe, one plain line every few steps and one per evaluation (no bar garbage)."""

from __future__ import annotations

import sys

from gpt2port.progress import tqdm_bar


class Progress:
    def __init__(self, steps: int, start: int, quiet: bool, every: int = 10):
        self.quiet, self.every, self.steps = quiet, every, steps
        self.bar = tqdm_bar(quiet, total=steps, initial=start, desc="fine-tuning", unit="step", dynamic_ncols=True)

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
        elif row["step"] % self.every == 0 or row["step"] == self.steps:
            self._line(f"step {row['step']}/{self.steps}: {text}")

    def _line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
