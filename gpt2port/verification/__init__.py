"""Proof of parity: a model's logits, stage by stage, against an independent float64 GPT-2 and transformers.

    from gpt2port.verification import run_verify, verify_model
    report = run_verify("checkpoints/gpt2")              # a converted checkpoint
    report = verify_model(model, "path/to/hf-repo")   # an in-memory GPT or a Stages adapter (any class)

Modules, each importable without the ones after it: reference (the float64 GPT-2), report (VerifyReport, the JSON
schema), tolerances, metrics, stages (the adapter a model is seen through), inputs, localize, hf, verdict, run.
"""

from gpt2port.verification.reference import Float64GPT2
from gpt2port.verification.report import SCHEMA, VerifyReport
from gpt2port.verification.tolerances import TOLERANCES
from gpt2port.verification.stages import GPTStages, Stages
from gpt2port.verification.inputs import KNOWN_ANSWER
from gpt2port.verification.run import run_verify, verify_model

__all__ = ["Float64GPT2", "GPTStages", "KNOWN_ANSWER", "SCHEMA", "Stages", "TOLERANCES", "VerifyReport", "run_verify",
           "verify_model"]
