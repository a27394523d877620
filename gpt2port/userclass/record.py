"""What load_into did to a model, kept on the model itself: the attribute `gpt2port_load` holds the LoadReport (the
settled layout, the notes, the proof, the history verify reads). It is visible (`model.gpt2port_load`), goes
wherever the model goes (a deepcopy carries it; `del model.gpt2port_load` forgets it), and save_from and
verify_model also take it explicitly (report=...). A module of its own so that readers need not import the loader."""

from __future__ import annotations

from torch import nn

ATTRIBUTE = "gpt2port_load"


def record(model: nn.Module, report) -> None:
    object.__setattr__(model, ATTRIBUTE, report)  # a plain attribute: not a submodule, parameter or buffer


def loaded(model: nn.Module, report=None):
    """The LoadReport of the load that filled `model` (or `report`, when one is handed over), or None."""
    return report if report is not None else getattr(model, ATTRIBUTE, None)
