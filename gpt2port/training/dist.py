"""One training process or many, through PyTorch's own distributed stack: torchrun sets the environment, this
module starts the process group (NCCL on GPUs, gloo on CPU), builds the model on the meta device, wraps it for data
parallelism (DDP) or full sharding (FSDP2's fully_shard), and gives every rank only its own part of the weights
read from the checkpoint's memory map (a sharded rank never holds the whole model).

A single process (no torchrun) is world 1 with no process group: the same code, collectives skipped.

How a rank's process ends: see exit_rank.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpt2port.errors import GPT2PortError


@dataclass
class Runtime:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    sharded: bool

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of a few numbers over ranks (as float64; nothing to do on one rank)."""
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank if it is True on any (how ranks agree to stop at the same step)."""
        return self.sum([1.0 if flag else 0.0])[0] > 0

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def start(device: str | None, fsdp: bool) -> Runtime:
    """The runtime of this process: world and rank from torchrun's environment (world 1 without it)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind.startswith("cuda"):
        if not torch.cuda.is_available():
            raise GPT2PortError("--device cuda: no CUDA device is available to this process")
        dev = torch.device("cuda", local_rank if world > 1 else (torch.device(kind).index or 0))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device(kind)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30),
                                device_id=dev if dev.type == "cuda" else None)
    return Runtime(rank, world, local_rank, dev, sharded=fsdp)


def build(config, rt: Runtime, weights: dict[str, torch.Tensor], adapt=None, recompute: int = 0) -> torch.nn.Module:
    """gpt2port's GPT in fp32 on rt.device, wrapped for this runtime, holding the checkpoint's weights.

    weights: the checkpoint's tensors as views of its memory map; each rank reads only the rows it keeps.
    adapt(model): changes the filled model before DDP wraps it (LoRA's modules, the base frozen). Under FSDP,
    which shards the modules it is given, adapt(model, weights) changes the model still on the meta device and
    returns the tensors that fill it (the adapters' initial values, the base under its new names).
    recompute: the first blocks whose activations are recomputed in the backward (training/recompute.py; hooks on
    the blocks, placed before fully_shard's).
    Returns the wrapped module (DDP / fully_shard'ed GPT / plain GPT).
    """
    from gpt2port.model import GPT

    with torch.device("meta"):
        model = GPT(config)
    if recompute:
        from gpt2port.training.recompute import attach

        attach(model, recompute)
    if rt.sharded and adapt is not None:
        weights, adapt = adapt(model, weights), None
    if rt.sharded:
        from torch.distributed.fsdp import fully_shard

        # One unit per block (its parameters gathered just before it runs, freed after), and the root for the
        # embeddings, final norm and the tied head.
        for block in model.blocks:
            fully_shard(block, mesh=_mesh(rt))
        fully_shard(model, mesh=_mesh(rt))
    model.to_empty(device=rt.device)
    if config.tie_word_embeddings and not rt.sharded:
        # to_empty moves each module's parameters on its own, which unties the head: tie it again (fully_shard
        # manages its parameters itself and keeps the one shared Parameter)
        model.lm_head.weight = model.tok_emb.weight
    _fill(model, weights)
    if adapt is not None:
        adapt(model)
    if rt.distributed and not rt.sharded:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[rt.device.index] if rt.device.type == "cuda" else None)
    return model


def _mesh(rt: Runtime):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(rt.device.type, (rt.world,))


@torch.no_grad()
def _fill(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy each parameter's part of the checkpoint into it: the whole tensor, or a sharded parameter's own rows
    (FSDP2 shards dim 0 as torch.chunk does: ceil(rows / world) per rank, the last ranks possibly fewer)."""
    for name, p in model.named_parameters():
        src = weights.get(name)
        if src is None:
            raise GPT2PortError(f"checkpoint has no tensor {name!r} for the model being trained")
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.shape != src.shape:  # a shard: this rank's rows
            per = -(-src.shape[0] // p.device_mesh.size())
            start = per * p.device_mesh.get_local_rank()
            src = src[start : start + local.shape[0]]
        local.copy_(src)


def exit_rank(code) -> None:
    """Under torchrun (WORLD_SIZE > 1): end this rank's process now with exit status `code` (a SystemExit code),
    its output flushed, without the interpreter's shutdown. A single process returns: its shutdown is ordinary.

    Why: gloo's threads (two workers and a socket loop per group) outlive destroy_process_group. gloo has no
    shutdown; they stop only when the last reference to the group goes, and torch keeps references of its own
    (module default arguments, DTensor's caches, more after an FSDP optimizer step). Python's finalization and the
    C++ static destructors would run beside them while the other rank exits and closes its sockets: code not made
    for that, where a thread taking the GIL is ended by pthread_exit and a std::thread may be destroyed still
    running, either of which aborts the process (SIGABRT, "terminate called without an active exception"). _exit
    runs nothing more. Nothing is lost: every file is closed and in place by now, and a run that ended well
    (finished, or stopped on request) has passed its last barrier on every rank. (A library caller under torchrun
    owns its process; this is for the command line.)"""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(code)
