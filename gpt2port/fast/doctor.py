"""`gpt2port doctor`: build gpt2port's CPU kernels on purpose, and say what this machine gives generation."""

from __future__ import annotations

import os

import torch

from gpt2port.fast import native
from gpt2port.fast.kernels import choose, onednn_works
from gpt2port.fast.settings import Settings
from gpt2port.fast.speed import matvec_bandwidth


def busy() -> str:
    """A note when other work keeps this machine busy (the last minute's load average at or above its cores): what
    doctor measures then is what is left over, not what the machine gives."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):  # no load average on this system
        return ""
    if load < cores:
        return ""
    return (f"; note: this machine is busy (load average {load:.1f} on {cores} cores): other work takes its share, "
            f"so this and generate's speed are lower than the machine gives when quiet")


def report(settings: Settings | None = None) -> list[str]:
    """Lines for the user: PyTorch and its threads, the kernels (built here if they are not yet), the memory
    bandwidth a decode step can use, and the kernels `generate` will run on per dtype."""
    from gpt2port.quant import _fbgemm_works

    settings = settings or Settings.from_env()
    lines = [f"torch {torch.__version__}; {torch.get_num_threads()} threads (of {os.cpu_count()} CPUs)"]
    if not settings.native:
        lines.append("gpt2port's CPU kernels: switched off (GPT2PORT_NATIVE=0)")
    else:
        built = native.kernels()
        where = native.cache_dir()
        if built.why_not is not None:
            lines.append(f"gpt2port's CPU kernels: not available ({built.why_not}); PyTorch's are used")
        elif built.binding_why_not is not None:
            lines.append(f"gpt2port's CPU kernels: one-row product through Python only ({built.binding_why_not}); "
                         f"cache {where}")
        else:
            lines.append(f"gpt2port's CPU kernels: built (one-row products, one-token attention, LayerNorm and GELU on "
                         f"one row, the replay of a step); cache {where}")
    lines.append(f"oneDNN linear: {'works' if onednn_works() else 'not available'}; "
                 f"fbgemm int8: {'works' if _fbgemm_works() else 'not available'}")
    lines.append(f"memory bandwidth (one-row product, 256 MB weight): {matvec_bandwidth('cpu') / 1e9:.1f} GB/s"
                 f"{busy()}")
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.empty(8, 8, dtype=dtype)
        lines.append(f"generate on the CPU, {str(dtype).removeprefix('torch.')}: decode products on "
                     f"{choose(w, None, 1, settings)}, prefill on {choose(w, None, 2, settings)}")
    lines.append("generate --dtype int8: decode products on " + ("fbgemm" if _fbgemm_works() else "int8pack"))
    one_row = settings.native and settings.attend_one and native.kernels().attend_one
    if settings.compile:
        how = "compiled ahead of time (AOTInductor)" if one_row else \
            "not compiled (attention is not on gpt2port's kernel)"
    elif not settings.replay:
        how = "called from Python each step (GPT2PORT_REPLAY=0; GPT2PORT_COMPILE=1 compiles it)"
    elif one_row:
        how = "replayed from C++ after its first step (GPT2PORT_COMPILE=1 compiles it instead)"
    else:
        how = "called from Python each step (a replay needs gpt2port's attention kernel)"
    lines.append(f"decode steps of one row on the CPU: the model's forward, {how}")
    if torch.cuda.is_available():
        graph = "recorded as a CUDA graph" if settings.cuda_graph else "not recorded (GPT2PORT_CUDA_GRAPH=1 records it)"
        lines.append(f"CUDA: {torch.cuda.get_device_name()}; decode step {graph}")
    else:
        lines.append("CUDA: not available")
    return lines
