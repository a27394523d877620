"""The layouts gpt2port writes: REGISTRY, the one table that names them (their writers are gpt2port/targets/).

The table is plain data, so the command line can offer the names and encodings as choices without importing the
writers (and torch, gguf), and the ownership rule (ownership.py) can name the files each target writes without
importing any writer: a writer's module is imported only when conversion.convert writes that target.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    name: str
    module: str  # gpt2port.targets.<module> (or a dotted path), whose write(job) -> bytes written writes it
    dtypes: tuple[str, ...]  # the float dtypes its files hold
    encodings: tuple[str, ...] = ()  # its own encodings beyond those, produced in fp32 and encoded by its writer
    options: tuple[str, ...] = ()  # switches its writer takes (convert(..., options=))
    streamed: bool = False  # its writer (stream_safetensors) takes prefetch.Streamed items, copied in pieces
    tanh_gelu: bool = False  # its files cannot name the MLP's activation: their readers always compute the tanh GELU
    # The names (shell patterns; TOKENIZER: the tokenizer files) of the files its writer puts in an output directory,
    # manifest.json included: all that --force may replace in an output of this target (ownership.py).
    files: tuple[str, ...] = ()
    layout: str = ""  # the layouts/ entry its tensors are planned in, when not named like the target

    def writer(self):
        return importlib.import_module(self.module if "." in self.module else f"gpt2port.targets.{self.module}").write


TOKENIZER = "<tokenizer files>"  # stands for tokenizer.TOKENIZER_FILES (not imported here: this table stays plain data)
CHECKPOINT_FILES = ("model.safetensors", "config.json", "manifest.json", TOKENIZER)


FLOATS = ("fp32", "fp16", "bf16")
# llama.cpp's file types gpt2port writes (targets/gguf_recipe.py: which tensor takes which GGML type)
GGUF_QUANTS = ("q8_0", "q6_k", "q5_k_m", "q5_k_s", "q5_1", "q5_0", "q4_k_m", "q4_k_s", "q4_1", "q4_0")
REGISTRY = {t.name: t for t in (
    Target("gpt2port", "checkpoint", FLOATS, streamed=True, files=CHECKPOINT_FILES),
    Target("hf", "hf", FLOATS, streamed=True, files=CHECKPOINT_FILES),
    Target("llmc", "llmc", ("fp32", "bf16"), options=("debug_state",), tanh_gelu=True,
           files=("gpt2_*.bin", "manifest.json")),
    Target("gguf", "gguf", FLOATS, encodings=GGUF_QUANTS, options=("output_tensor",), tanh_gelu=True,
           files=("model.gguf", "manifest.json")),
    Target("onnx", "onnx", ("fp32", "fp16"), layout="gpt2port",
           files=("model.onnx", "model.onnx.data", "config.json", "genai_config.json", "manifest.json", TOKENIZER)),
)}

# Outputs written by a command of their own, not by conversion (not --to choices): their layout (as their
# manifest.json names it) -> the files they put in an output directory, for the ownership rule.
OTHER_OUTPUTS = {
    "gguf-lora": ("adapter.gguf", "manifest.json"),  # export ADAPTER --to gguf (gpt2port/lora/gguf.py)
}
# A fine-tuning run's adapter/ (finetune --lora): peft's adapter directory (gpt2port/lora/peft.py)
ADAPTER_DIR, ADAPTER_FILES = "adapter", ("adapter_config.json", "adapter_model.safetensors")

# Views of REGISTRY for the command line.
TARGETS = tuple(REGISTRY)
ENCODINGS = {t.name: t.encodings for t in REGISTRY.values() if t.encodings}
