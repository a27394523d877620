"""Meaning apart from bytes: the canonical GPT-2 tensor set and one table per layout that maps it.

Adding a layout is adding a module with one Layout table and a row in LAYOUTS.
"""

from gpt2port.errors import GPT2PortError
from gpt2port.layouts.gguf import GGUF
from gpt2port.layouts.gpt2port import GPT2PORT
from gpt2port.layouts.hf import HF
from gpt2port.layouts.llmc import LLMC
from gpt2port.layouts.llms_from_scratch import LLMS_FROM_SCRATCH
from gpt2port.layouts.nanogpt import NANOGPT
from gpt2port.layouts.openai_tf import OPENAI_TF
from gpt2port.layouts.table import Layout, Read, Row, Write

LAYOUTS = {layout.name: layout for layout in (GPT2PORT, HF, LLMC, GGUF, NANOGPT, LLMS_FROM_SCRATCH, OPENAI_TF)}
# The layouts a file of bare tensor names may be in, tried in this order: the first whose table explains every name
# and whose shapes make sense (Layout.explains) is taken. HF first: its messages are the ones to see when none fits.
STATE_DICT_LAYOUTS = (HF, NANOGPT, LLMS_FROM_SCRATCH)


def recognise(shapes: dict[str, tuple[int, ...]]) -> Layout:
    """The layout of a file with no format tag, from its names and shapes (HF when none explains them)."""
    return next((layout for layout in STATE_DICT_LAYOUTS if layout.explains(shapes)), HF)


def get(name: str) -> Layout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise GPT2PortError(f"unknown layout {name!r} (known: {', '.join(LAYOUTS)})") from None


__all__ = ["GGUF", "GPT2PORT", "HF", "LAYOUTS", "LLMC", "LLMS_FROM_SCRATCH", "NANOGPT", "OPENAI_TF",
           "STATE_DICT_LAYOUTS", "Layout", "Read", "Row", "Write", "get", "recognise"]
