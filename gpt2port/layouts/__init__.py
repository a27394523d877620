"""Meaning apart from bytes: the canonical GPT-2 tensor set and one table per layout that maps it.

Adding a layout is adding a module with one Layout table and a row in LAYOUTS.
"""

from gpt2port.errors import GPT2PortError
from gpt2port.layouts.gguf import GGUF
from gpt2port.layouts.gpt2port import GPT2PORT
from gpt2port.layouts.hf import HF
from gpt2port.layouts.llmc import LLMC
from gpt2port.layouts.table import Layout, Read, Row, Write

LAYOUTS = {layout.name: layout for layout in (GPT2PORT, HF, LLMC, GGUF)}


def get(name: str) -> Layout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise GPT2PortError(f"unknown layout {name!r} (known: {', '.join(LAYOUTS)})") from None


__all__ = ["GGUF", "GPT2PORT", "HF", "LAYOUTS", "LLMC", "Layout", "Read", "Row", "Write", "get"]
