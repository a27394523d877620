"""The LoRA module swapped in for an nn.Linear of model.py (setattr on its parent: the model's code is unchanged),
and the way back: merging each adapter into its base weight and putting the plain nn.Linear back.

    y = base(x) + scaling * B (A dropout(x))      A: (rank, in), B: (out, rank), base frozen

With parts=3 (q, k and v apart) the output is three slices, each with its own A and B: a rank-r update of each,
where one A for the fused (3C, C) matrix makes q, k and v share the same r input directions.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2port.errors import GPT2PortError
from gpt2port.lora.spec import TARGETS, Spec

MERGE_TOLERANCE = 1e-5  # merged against unmerged logits, relative to the largest logit (fp32)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, scaling: float, dropout: float = 0.0, parts: int = 1):
        super().__init__()
        out, inp = base.weight.shape
        self.base, self.rank, self.scaling, self.parts = base, rank, scaling, parts
        kw = {"device": base.weight.device, "dtype": torch.float32}
        self.lora_A = nn.Parameter(torch.zeros(parts, rank, inp, **kw))
        self.lora_B = nn.Parameter(torch.zeros(parts, out // parts, rank, **kw))
        self.dropout = nn.Dropout(dropout)

    @torch.no_grad()
    def reset(self, generator: torch.Generator | None = None) -> None:
        """As peft initialises: A as nn.Linear's default (Kaiming-uniform, a=sqrt(5)), B zero, so training starts
        from the base model exactly."""
        init_A_(self.lora_A, generator)
        self.lora_B.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = F.linear(self.dropout(x), self.lora_A.flatten(0, 1))  # (..., parts * rank)
        if self.parts == 1:
            d = F.linear(u, self.lora_B[0])
        else:
            d = torch.cat([F.linear(ui, bi) for ui, bi in zip(u.chunk(self.parts, -1), self.lora_B)], -1)
        return self.base(x) + d * self.scaling

    def delta(self) -> torch.Tensor:
        """scaling * B A as the base weight's (out, in), in fp32."""
        a, b = _full(self.lora_A).float(), _full(self.lora_B).float()
        return torch.cat([bi @ ai for ai, bi in zip(a, b)], 0) * self.scaling


def init_A_(a: torch.Tensor, generator: torch.Generator | None) -> None:
    for part in a:
        nn.init.kaiming_uniform_(part, a=math.sqrt(5), generator=generator)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A parameter as one whole tensor: a sharded one (FSDP's DTensor) gathered from every rank (collective)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return model.get_submodule(path), attr


def adapted(model: nn.Module) -> dict[str, LoRALinear]:
    """Every LoRA module of the model, by its name (blocks.0.attn.qkv)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def attach(model: nn.Module, spec: Spec, generator: torch.Generator | None = None) -> dict[str, LoRALinear]:
    """Freeze every parameter of gpt2port's GPT `model` and swap a fresh LoRA module in for each targeted matrix."""
    for p in model.parameters():
        p.requires_grad_(False)
    swapped = {}
    for i in range(len(model.blocks)):
        for t in spec.targets:
            name = f"blocks.{i}.{TARGETS[t]}"
            parent, attr = _parent(model, name)
            m = LoRALinear(getattr(parent, attr), spec.rank, spec.scaling, spec.dropout,
                           3 if spec.split_qkv and t == "qkv" else 1)
            m.reset(generator)
            setattr(parent, attr, m)
            swapped[name] = m
    return swapped


def attach_deltas(model: nn.Module, deltas: dict) -> None:
    """Swap in LoRA modules holding given adapters: deltas maps a module name (blocks.0.attn.qkv) to (A, B,
    scaling), A (rank, in) and B (out, rank), as an adapter file holds them. Frozen: for merging and checking."""
    for name, (a, b, scaling) in deltas.items():
        parent, attr = _parent(model, name)
        m = LoRALinear(getattr(parent, attr), a.shape[0], scaling)
        with torch.no_grad():
            m.lora_A.copy_(a.unsqueeze(0))
            m.lora_B.copy_(b.unsqueeze(0))
        m.requires_grad_(False)
        setattr(parent, attr, m)


def deltas_of(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """Each LoRA module as one (A, B, scaling) on its whole matrix, as peft and llama.cpp hold an adapter. Split
    q, k, v become one exact rank-3r adapter: A the three stacked, B block-diagonal."""
    out = {}
    for name, m in adapted(model).items():
        a = _full(m.lora_A.detach()).float().cpu()
        b = _full(m.lora_B.detach()).float().cpu()
        out[name] = (a.flatten(0, 1), torch.block_diag(*b), m.scaling)
    return out


def sharded_weights(model: nn.Module, weights: dict, generator: torch.Generator) -> dict:
    """What fills `model`, its adapters attached on the meta device (for FSDP to shard them with the base): the
    checkpoint's `weights` under the names the LoRA modules give the base (blocks.0.attn.qkv.base.weight), and
    each adapter's initial values, drawn from `generator` in attach's order."""
    out = dict(weights)
    for name, m in adapted(model).items():
        for p in ("weight", "bias"):
            out[f"{name}.base.{p}"] = weights[f"{name}.{p}"]
        out[f"{name}.lora_A"] = torch.empty(m.lora_A.shape)
        init_A_(out[f"{name}.lora_A"], generator)
        out[f"{name}.lora_B"] = torch.zeros(m.lora_B.shape)
    return out


def logits_of(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """The model's logits for idx (its forward returns (logits, loss))."""
    return model(idx)[0]


@torch.no_grad()
def merge_(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put the plain nn.Linear back: gpt2port's GPT again."""
    for name, m in adapted(model).items():
        w = m.base.weight
        delta = m.delta()
        if hasattr(w, "to_local"):  # FSDP: this rank's rows (dim 0 split as torch.chunk does)
            start = -(-delta.shape[0] // w.device_mesh.size()) * w.device_mesh.get_local_rank()
            w = w.to_local()
            delta = delta[start : start + w.shape[0]]
        w.copy_((w.float() + delta.to(w.device)).to(w.dtype))
        parent, attr = _parent(model, name)
        setattr(parent, attr, m.base)
    return model


@torch.no_grad()
def merge_checked(model: nn.Module, probe: torch.Tensor) -> float:
    """merge_(model), proven: the logits for `probe` (1, T) ids, before and after, agree to MERGE_TOLERANCE
    relative to the largest logit; returns that difference. The model is left in eval mode."""
    model.eval()
    probe = probe.to(next(model.parameters()).device)
    before = logits_of(model, probe).float()
    merge_(model)
    after = logits_of(model, probe).float()
    diff = ((after - before).abs().max() / before.abs().max().clamp_min(1e-30)).item()
    if not diff <= MERGE_TOLERANCE:
        raise GPT2PortError(f"merging the adapter changed the logits by {diff:.2e} relative (more than "
                            f"{MERGE_TOLERANCE:.0e}); nothing was written")
    return diff


def probe_ids(config, n: int = 16, seed: int = 0) -> torch.Tensor:
    """Fixed token ids for the merge check."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (1, min(n, config.n_positions)), generator=g)
