"""The layouts gpt2port writes, and the encodings each takes beyond fp32/fp16/bf16, by name only.

Names without their writers, so that the command line can offer them as choices without importing the converters
(and torch): conversion.WRITERS maps each name here to the function that writes it.
"""

TARGETS = ("gpt2port", "hf", "llmc", "gguf")
ENCODINGS = {"gguf": ("q8_0",)}  # produced in fp32, encoded by the target's writer
