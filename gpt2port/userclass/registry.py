"""What load_into recorded for each model it filled (its LoadReport: the settled layout and the load's history),
kept beside the model for as long as the model lives; read by verify_model's view of the class and by save_from.
A module of its own so that verify's view of a class (stages.py) reads it without importing the loader."""

from __future__ import annotations

import weakref

from torch import nn

_LOADED: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()


def record(model: nn.Module, report) -> None:
    _LOADED[model] = report


def loaded(model: nn.Module):
    """The LoadReport of the load that filled `model`, or None."""
    return _LOADED.get(model)
