"""What a LoRA run adapts, and the one check of it: rank, alpha, targets, q|k|v split and dropout.

Targets are named by role (the option's words) and map to the module of each block they replace; widths come
from the config, so a rank beyond a layer's width is refused before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpt2port.config import GPTConfig
from gpt2port.errors import GPT2PortError

# option word -> the module in each block (gpt2port's names), in the order blocks run them
TARGETS = {"qkv": "attn.qkv", "attn_proj": "attn.proj", "fc": "mlp.fc", "mlp_proj": "mlp.proj"}
DEFAULT_TARGETS = "qkv"  # peft's default for GPT-2 (c_attn alone)


@dataclass(frozen=True)
class Spec:
    rank: int
    alpha: float
    targets: tuple[str, ...]  # option words, in TARGETS order
    split_qkv: bool = False  # q, k and v each their own A and B
    dropout: float = 0.0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "split_qkv": self.split_qkv,
                "dropout": self.dropout}


def widths(config: GPTConfig, target: str) -> tuple[int, int]:
    """(inputs, outputs) of a target's matrix."""
    C, M = config.n_embd, config.mlp_width
    return {"qkv": (C, 3 * C), "attn_proj": (C, C), "fc": (C, M), "mlp_proj": (M, C)}[target]


def parse_targets(text: str) -> tuple[str, ...]:
    parts = text if isinstance(text, (list, tuple)) else str(text).split(",")  # Python callers may pass a list
    words = [str(w).strip() for w in parts if str(w).strip()]
    unknown = [w for w in words if w not in TARGETS]
    if unknown or not words:
        given = ",".join(map(str, parts))
        raise GPT2PortError(f"--lora-targets {given}: unknown target(s) {', '.join(unknown) or '(none given)'} "
                            f"(known: {', '.join(TARGETS)})")
    return tuple(t for t in TARGETS if t in words)


def spec(rank, alpha, targets, split_qkv, dropout, config: GPTConfig) -> Spec | None:
    """The checked Spec of finetune's --lora options (None: no LoRA, a full fine-tune); one line on what is wrong."""
    if rank is None:
        extra = [o for o, v in (("--lora-alpha", alpha), ("--lora-split-qkv", split_qkv),
                                ("--lora-dropout", dropout)) if v]
        if targets not in (None, DEFAULT_TARGETS):
            extra.insert(0, "--lora-targets")
        if extra:
            raise GPT2PortError(f"{', '.join(extra)}: LoRA options need --lora RANK")
        return None
    if rank < 1:
        raise GPT2PortError(f"--lora {rank}: the rank must be at least 1")
    words = parse_targets(targets or DEFAULT_TARGETS)
    for t in words:
        n_in, n_out = widths(config, t)
        if split_qkv and t == "qkv":
            n_out //= 3
        if rank > min(n_in, n_out):
            raise GPT2PortError(f"--lora {rank}: above the width of {TARGETS[t]} ({n_in} inputs, {n_out} outputs"
                                f"{' per q, k, v' if split_qkv and t == 'qkv' else ''}); the rank can be at most "
                                f"{min(n_in, n_out)}")
    if split_qkv and "qkv" not in words:
        raise GPT2PortError(f"--lora-split-qkv: the targets ({','.join(words)}) do not include qkv")
    alpha = float(rank if alpha is None else alpha)
    if not 0 < alpha < float("inf"):
        raise GPT2PortError(f"--lora-alpha {alpha}: must be a finite number above 0")
    dropout = float(dropout or 0.0)
    if not 0 <= dropout < 1:
        raise GPT2PortError(f"--lora-dropout {dropout}: must be in [0, 1)")
    return Spec(rank, alpha, words, bool(split_qkv), dropout)
