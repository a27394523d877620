"""Activation checkpointing for `gpt2port finetune --checkpoint-activations [N]`: the first N blocks keep only their
input for the backward, and run their forward again there to get what the gradients need; the other blocks keep
their activations as usual. Memory for compute: a recomputed block holds one (batch, tokens, width) tensor instead
of everything its backward needs, at the cost of its forward once more per step; only as many blocks as a memory
budget needs may be recomputed (N below the model's depth). The figures are in docs/finetune.md.

Attached from outside with torch's composable `checkpoint` (non-reentrant): hooks on each chosen Block, so
model.py's forward is the one that runs, twice; the module tree, parameter names and state_dict are unchanged, and
so are the saved training state and the checkpoint written. The recomputation replays the forward with the random
state it first had (dropout draws the same masks) and the same operations in the same order: losses and gradients
are those of the run without it, bit for bit (tested). It composes with LoRA (a bf16-held base too), DDP and FSDP
(applied before fully_shard, whose hooks gather a block's parameters again for the recomputation); not with
torch.compile, whose trace of the hooks fails the recomputation's own check of what it recomputed (refused).
"""

from __future__ import annotations

import torch

from gpt2port.errors import GPT2PortError

EVERY = -1  # the Python callers' and the bare option's value: every block


def resolve(n: int, n_layer: int, compile_model: bool = False) -> int:
    """The number of blocks recomputed for --checkpoint-activations `n` (EVERY: all of them), checked against the
    model's `n_layer` blocks and the run's other options; one line on what is wrong."""
    if n == EVERY:
        n = n_layer
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= n_layer:
        raise GPT2PortError(f"--checkpoint-activations {n}: the number of blocks recomputed must be between 0 and "
                            f"the model's {n_layer} (bare: all of them)")
    if n and compile_model:
        raise GPT2PortError("--checkpoint-activations with --compile: not supported (torch.compile does not "
                            "reproduce the recomputation); use one or the other")
    return n


def attach(model: torch.nn.Module, n: int) -> list[int]:
    """Recompute the activations of the first `n` blocks of gpt2port's GPT `model` in the backward (hooks on each;
    nothing else of the model changes). Returns the blocks' indices."""
    if n <= 0:
        return []
    from torch.distributed._composable import checkpoint

    chosen = list(range(min(n, len(model.blocks))))
    for i in chosen:
        checkpoint(model.blocks[i])
    return chosen


def recomputed(model: torch.nn.Module) -> list[int]:
    """The indices of the blocks of `model` whose activations are recomputed (attach's)."""
    from torch.distributed._composable import checkpoint

    return [i for i, b in enumerate(model.blocks) if checkpoint.state(b) is not None]


def said(n: int, n_layer: int) -> str:
    """The line a run prints when it starts."""
    which = "every block" if n == n_layer else f"the first {n} of {n_layer} blocks"
    return (f"activation checkpointing: {which} recomputed in the backward (their activations not kept; one more "
            f"forward through them per step)")
