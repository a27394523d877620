"""verify_model for any class: a user's own class is read as load_into filled it (ModelStages, with the history the
load recorded), then verified by gpt2port.verification like gpt2port's GPT. userclass depends on verification, never
the other way round."""

from __future__ import annotations

import torch
from torch import nn

from gpt2port.verification.run import verify_model as _verify_model
from gpt2port.verification.stages import Stages


def verify_model(model, reference, **options):
    """gpt2port.verify_model: does `model` (gpt2port's GPT, your own class, or a Stages adapter) compute GPT-2?
    Options as gpt2port.verification.verify_model (tokens, progress, known_answer, tokenizer_dir, hf, grads), and
    report: the LoadReport of the load that filled a class of your own (default: model.gpt2port_load)."""
    from gpt2port.model import GPT

    if isinstance(model, nn.Module) and not isinstance(model, (GPT, Stages)):
        from gpt2port.errors import GPT2PortError
        from gpt2port.userclass.stages import stages_for

        if options.get("grads"):
            raise GPT2PortError(f"{type(model).__name__}: gradient parity is checked for gpt2port's GPT (save_from a "
                                f"class of your own, then verify its checkpoint with grads)")
        model = stages_for(model, reference, options.pop("report", None))  # with the load's history
        if model.dtype == torch.float64:  # at least as precise as fp32: judged at fp32's tolerances, beside fp32 HF
            model.precision = "fp32"
    return _verify_model(model, reference, **options)
