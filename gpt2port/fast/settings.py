"""Settings: which of gpt2port.fast's accelerations to use, passed explicitly (no module switches)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    """Each field switches one acceleration; the defaults are what `generate` uses. Every acceleration changes only
    speed, never a number beyond float rounding, so each can be switched off to compare or to debug."""

    native: bool = True  # gpt2port's own one-row product (matvec.c), built on first use (fast.native)
    attend_one: bool = True  # gpt2port's attention for one new token of one sequence (attention.c)
    onednn: bool = True  # fp32 products of several rows (prefill) on oneDNN rather than F.linear's MKL
    cuda_graph: bool = False  # decode steps (the model's forward) as a CUDA graph on CUDA: opt-in until a GPU proves it
    # one row's decode steps on the CPU: the model's forward compiled ahead of time (fast.package: torch.export and
    # AOTInductor), opt-in: the first run of a model shape compiles for tens of seconds (docs/performance.md)
    compile: bool = False
    # one row's decode steps on the CPU: the model's forward recorded once as its operator calls and replayed from C++
    # (fast.replay), checked against the forward on a scratch cache first; compile, where asked, takes precedence
    replay: bool = True

    @classmethod
    def from_env(cls) -> "Settings":
        """The defaults, with GPT2PORT_NATIVE=0 (no C build), GPT2PORT_CUDA_GRAPH=1 (record the decode step),
        GPT2PORT_COMPILE=1 (compile it on the CPU) and GPT2PORT_REPLAY=0 (call the forward from Python each step)
        applied: how the command line is switched without a flag."""
        return cls(native=os.environ.get("GPT2PORT_NATIVE", "1") != "0",
                   cuda_graph=os.environ.get("GPT2PORT_CUDA_GRAPH", "0") == "1",
                   compile=os.environ.get("GPT2PORT_COMPILE", "0") == "1",
                   replay=os.environ.get("GPT2PORT_REPLAY", "1") != "0")


OFF = Settings(native=False, attend_one=False, onednn=False, cuda_graph=False, replay=False)
