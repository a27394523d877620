"""`gpt2port eval` under torchrun: the batches dealt round-robin over the ranks, and every rank's results gathered to
every rank, which computes the figures from them as one process does. The batches are the ones one process would
run (every rank cuts the same list the same way), so each example's numbers, and the figures, are the same bit for
bit; the first rank prints them.

One process (no torchrun) is world 1: every batch its own, nothing gathered.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

    def mine(self, batch: int) -> bool:
        """Whether this rank runs the batch numbered `batch` (from 0, in the order every rank cuts them)."""
        return batch % self.world == self.rank

    def gather(self, found: dict) -> dict:
        """Every rank's `found` (keys of its own batches' results) merged, on every rank."""
        if self.world == 1:
            return found
        import torch.distributed as dist

        parts = [None] * self.world
        dist.all_gather_object(parts, found)
        return {k: v for part in parts for k, v in part.items()}


ONE = Ranks()


def first() -> bool:
    """Whether this process is the first rank of torchrun's, or the only process: the one that prints."""
    return int(os.environ.get("RANK", "0")) == 0


def start(device: str) -> tuple[Ranks, str]:
    """This process's rank and the device it computes on: under torchrun (WORLD_SIZE > 1) the process group is
    started as `finetune` starts it (gloo on CPU, NCCL on GPUs, a GPU per rank)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return ONE, device
    from gpt2port.training import dist

    rt = dist.start(device, fsdp=False)
    return Ranks(rt.rank, rt.world), str(rt.device)
