"""The layouts gpt2port writes: one module per target (its writer); REGISTRY, the one table that names them, is
gpt2port/registry.py (a top-level module: ownership.py reads it, and the writers here write through fsio).
"""

from gpt2port.registry import ENCODINGS, FLOATS, REGISTRY, TARGETS, TOKENIZER, Target

__all__ = ["ENCODINGS", "FLOATS", "REGISTRY", "TARGETS", "TOKENIZER", "Target"]
