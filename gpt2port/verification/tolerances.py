"""How far each precision may stray from the float64 reference before verify calls it a failure."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    logits_rel: float  # max|Δlogit| / max|ref logit|, end to end and for the decode steps
    kl: float  # mean KL(ref || ours) of next-token distributions, nats
    local_rel: float  # one stage (embeddings, attention, MLP, final norm, head) on the reference's own input
    loss: float  # |loss_ours - loss_ref| on the natural text, nats
    vs_hf_factor: float = 2.0  # ours vs HF: both carry up to one tolerance of error, so allow their sum


# 5-10x the worst error either implementation showed against float64 on random-weight GPT-2s, measured by
# scripts/bench/verify.py (fp32 and int8 with 2x1024 random ids, fp16/bf16 with 2x128):
#                      logits max rel   KL        worst stage   KV-cached   loss diff
#     fp32  124M       1.4e-6           1.5e-13   1.4e-6        1.3e-6      1.3e-7
#     fp32  355M       1.5e-6           2.7e-13   1.3e-6        1.3e-6      6.0e-8
#     fp32  774M       2.0e-6           5.0e-13   2.0e-6        1.7e-6      6.1e-8
#     fp32  1.5B       1.9e-6           6.5e-13   1.9e-6        1.6e-6      1.6e-7
#     fp16  124M       1.6e-3           3.1e-7    8.3e-4        1.8e-3      1.8e-4
#     bf16  124M       1.3e-2           2.0e-5    7.2e-3        1.3e-2      3.8e-3
#     int8  124M       2.5e-2           8.6e-5    1.3e-2        2.6e-2      4.4e-4
# int8 is ours alone (GPT.from_pretrained(..., dtype="int8"), gpt2port.quant), HF beside it in fp32: its error is
# the weights' rounding to 8 bits, systematic rather than random, so its tolerances are 4-12x the measured error.
# In fp32 ours (oneDNN's products, see model.Linear) errs about twice as much as HF (MKL's); fp16/bf16: HF's errors
# were the same to two digits. KL gets extra room: it grows with the square of the logit scale, and real GPT-2 logits
# (|logit| ~ 100) are larger than random-weight ones. The seeded bugs of tests/verification/test_verify.py land at
# stage errors from 1.7e-4 (erf GELU) upwards, above every fp32 tolerance here.
TOLERANCES = {
    "fp32": Tolerance(logits_rel=1e-5, kl=1e-6, local_rel=1e-5, loss=1e-5),
    "fp16": Tolerance(logits_rel=1.5e-2, kl=1e-3, local_rel=1e-2, loss=5e-3),
    "bf16": Tolerance(logits_rel=1e-1, kl=1e-2, local_rel=5e-2, loss=5e-2),
    "int8": Tolerance(logits_rel=1e-1, kl=1e-3, local_rel=5e-2, loss=5e-3),
}
PRECISION_ORDER = ["fp32", "fp16", "int8", "bf16"]  # finer to coarser


def tolerance_for(compute: str, weights: str) -> Tolerance:
    """Weights rounded to fp16/bf16 by the conversion stay rounded when computed in fp32: judge by the coarser one."""
    return TOLERANCES[max(compute, weights, key=PRECISION_ORDER.index)]
