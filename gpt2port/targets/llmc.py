"""The llmc target: the files llm.c's C code loads, in one directory written whole or not at all.

    gpt2_124M.bin                 the weights (formats.llmc; named after the size, gpt2_model.bin for others)
    gpt2_tokenizer.bin            the token bytes, for llm.c's decoder
    gpt2_124M_debug_state.bin     with options {"debug_state": True}: a batch of real text, the logits, the loss and
                                  every gradient, computed by gpt2port's model; llm.c's test_gpt2 checks its own C
                                  forward and backward against them
"""

from __future__ import annotations

import itertools

import torch

from gpt2port.config import GPTConfig
from gpt2port.dtypes import DTYPE_LABELS, label
from gpt2port.errors import GPT2PortError
from gpt2port.formats.llmc import (MODEL_MAGIC, MODEL_VERSIONS, TOKENIZER_FILE, header, state_header, tokenizer_bytes,
                                   write_raw)
from gpt2port.fsio import write_file
from gpt2port.layouts.llmc import LLMC, padded_vocab
from gpt2port.readers.llmc import LlmcReader
from gpt2port.targets import REGISTRY
from gpt2port.tokenizer import from_directory

OPTIONS = REGISTRY["llmc"].options
# llm.c names its model file by the parameter count of the four official sizes.
SIZE_NAMES = {(12, 768): "124M", (24, 1024): "355M", (36, 1280): "774M", (48, 1600): "1558M"}
# The batch llm.c's test_gpt2 expects: B sequences of T tokens.
BATCH, SEQ_LEN = 4, 64
# A fixed English text for the debug state's batch (the MIT license, as the project is licensed), repeated as
# needed: real text gives the model realistic activations, and a fixed one makes the file reproducible.
TEXT = (
    "Permission is hereby granted, free of charge, to any person obtaining a copy of this software and associated "
    "documentation files (the \"Software\"), to deal in the Software without restriction, including without "
    "limitation the rights to use, copy, modify, merge, publish, distribute, sublicense, and/or sell copies of the "
    "Software, and to permit persons to whom the Software is furnished to do so, subject to the following "
    "conditions:\n\nThe above copyright notice and this permission notice shall be included in all copies or "
    "substantial portions of the Software.\n\nTHE SOFTWARE IS PROVIDED \"AS IS\", WITHOUT WARRANTY OF ANY KIND, "
    "EXPRESS OR IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR "
    "PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, "
    "DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT OF OR IN "
    "CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.\n"
)


def model_file_name(config: GPTConfig) -> str:
    return f"gpt2_{SIZE_NAMES.get((config.n_layer, config.n_embd), 'model')}.bin"


def state_file_name(config: GPTConfig) -> str:
    return model_file_name(config).removesuffix(".bin") + "_debug_state.bin"


def model_header(config: GPTConfig, dtype: torch.dtype) -> bytes:
    version = next((v for v, d in MODEL_VERSIONS.items() if d == dtype), None)
    if version is None:
        raise GPT2PortError(f"llm.c model files hold fp32 or bf16, not {dtype}; pass --dtype fp32 or bf16")
    return header(MODEL_MAGIC, version, config.n_positions, config.vocab_size, config.n_layer, config.n_head,
                  config.n_embd, padded_vocab(config.vocab_size))


def write(job) -> int:
    """The writer for "llmc" (job: a conversion.Job). Returns the model file's size."""
    config, where = job.source.config, job.source.where
    unknown = sorted(set(job.options) - set(OPTIONS))
    if unknown:
        raise GPT2PortError(f"llm.c export: unknown option(s) {', '.join(unknown)} (known: {', '.join(OPTIONS)})")
    if DTYPE_LABELS.get(job.dtype) not in REGISTRY["llmc"].dtypes:
        raise GPT2PortError(f"{where}: llm.c model files hold fp32 or bf16, not {label(job.dtype)}; pass --dtype fp32 "
                            f"or bf16")
    if job.options.get("debug_state") and not job.source.tokenizer_names():
        raise GPT2PortError(f"{where}: the debug state needs the checkpoint's tokenizer, and there is none")
    with job.staged() as stage:
        tokenizer = job.source.tokenizer_files()  # rebuilt (from a GGUF, llm.c's file) inside the stage
        encoding = from_directory(tokenizer[0].parent) if tokenizer else None
        model_file = stage / model_file_name(config)
        size = write_raw(model_file, model_header(config, job.dtype), job.items, job.progress)
        LlmcReader(model_file).close()  # read back: header, sizes and length as a reader will see them
        if encoding is None:
            job.warnings.append(f"{where}: no tokenizer files; {TOKENIZER_FILE} not written")
        else:
            tokens = [encoding.decode_single_token_bytes(i) for i in range(encoding.max_token_value + 1)]
            write_file(stage / TOKENIZER_FILE, tokenizer_bytes(tokens, encoding.eot_token))
        if job.options.get("debug_state"):
            write_debug_state(stage / state_file_name(config), job.source, job.dtype, encoding)
        job.write_manifest(stage, "llmc")
    return size


def batch(encoding, batch_size: int = BATCH, seq_len: int = SEQ_LEN) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (B, T): TEXT's tokens, the targets shifted by one."""
    ids = encoding.encode_ordinary(TEXT)
    ids = list(itertools.islice(itertools.cycle(ids), batch_size * seq_len + 1))
    t = torch.tensor(ids, dtype=torch.long)
    return t[:-1].view(batch_size, seq_len), t[1:].view(batch_size, seq_len)


def debug_state(ckpt_dir, dtype: torch.dtype, encoding):
    """(x, y, logits, loss, grads by canonical name) from gpt2port's model in fp32, its weights first rounded to
    `dtype` so the state matches the exported model file."""
    from gpt2port.model import GPT  # the model only for this option: plain exports never build one

    model = GPT.from_pretrained(ckpt_dir, dtype=torch.float32)
    if dtype != torch.float32:  # fp32 weights are the file's already: rounding them would only copy every page
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype))
    model.requires_grad_(True)
    x, y = batch(encoding)
    logits, loss = model(x, y)
    loss.backward()
    # The head is tied: tok_emb.weight's gradient already holds the head's share, as llm.c's dwte does.
    grads = {name: p.grad for name, p in model.named_parameters()}
    return x, y, logits.detach(), loss.detach(), grads


def write_debug_state(path, source, dtype: torch.dtype, encoding) -> None:
    if source.layout.name != "gpt2port":
        raise GPT2PortError(f"{source.where}: the debug state is computed from a gpt2port checkpoint; convert this "
                            f"source first, then export it")
    x, y, logits, loss, grads = debug_state(source.root, dtype, encoding)
    f32, i32 = torch.float32, torch.int32
    items = [("x", i32, tuple(x.shape), lambda: x), ("y", i32, tuple(y.shape), lambda: y),
             ("logits", f32, tuple(logits.shape), lambda: logits), ("loss", f32, (1,), lambda: loss.view(1))]
    for w in LLMC.order(LLMC.plan_write(source.config)):
        items.append((w.key, f32, w.shape, lambda w=w: w.transform.to_layout(grads[w.source])))
    write_raw(path, state_header(*x.shape), items)
