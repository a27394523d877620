"""The gguf target: one self-contained model.gguf (weights, sizes, tokenizer) that llama.cpp loads as it is.

Which tensors go in which GGML type (a quantized file type: llama.cpp's recipe, targets/gguf_recipe.py), and the
metadata llama.cpp's gpt2 loader reads; the bytes are written by formats/gguf.py (imported only here and when a
.gguf is read: see its docstring).
"""

from __future__ import annotations

from pathlib import Path

import gguf

from gpt2port.config import GPTConfig
from gpt2port.dtypes import DTYPE_LABELS
from gpt2port.errors import GPT2PortError
from gpt2port.formats.gguf import ENCODINGS, FILE_TYPES, Q, write_gguf
from gpt2port.targets.gguf_recipe import RECIPES, tensor_type
from gpt2port.layouts import GGUF, canonical
from gpt2port.layouts.gguf import ARCH
from gpt2port.targets import REGISTRY
from gpt2port.tokenizer import ENDOFTEXT, bpe_tables, defines_tokenizer

FILE_NAME = "model.gguf"  # the one file an export writes into its directory
# What --dtype means in a GGUF: the type of every matrix (fp32, fp16, bf16), or a file type whose recipe picks each
# matrix's (q4_k_m, ...). Norms, biases and the position table stay F32 whatever is chosen, as llama.cpp's own
# converter and quantizer keep them (they are small, and the loader adds them in F32 anyway).
KEEP_F32 = {GGUF.key_for("pos_emb.weight")}
# output_tensor: also write the tied head as output.weight, for loaders that need it
OPTIONS = set(REGISTRY["gguf"].options)


def storage_type(key: str, shape: tuple[int, ...], encoding: str, n_layer: int, tied: bool) -> Q:
    if len(shape) == 1 or key in KEEP_F32:
        return Q.F32
    return tensor_type(key, shape, encoding, n_layer, tied) if encoding in RECIPES else ENCODINGS[encoding]


def write(job) -> int:
    """The writer for "gguf" (job: a conversion.Job). Returns the file's size."""
    unknown = sorted(set(job.options) - OPTIONS - {"encoding"})
    if unknown:
        raise GPT2PortError(f"unknown gguf option(s) {', '.join(unknown)} (known: {', '.join(sorted(OPTIONS))})")
    if not defines_tokenizer(job.source.tokenizer_names()):
        raise GPT2PortError(f"{job.source.root}: no tokenizer files beside the weights; a GGUF must embed one")
    items = list(job.items)
    if job.options.get("output_tensor") and job.source.config.tie_word_embeddings:
        # the tied head once more, under the name older loaders require (an untied head is written anyway)
        _, dtype, shape, produce = next(i for i in items if i[0] == GGUF.key_for(canonical.EMBEDDING))
        items.append((GGUF.untied_head, dtype, shape, produce))
    encoding = job.options.get("encoding") or DTYPE_LABELS[job.dtype]
    with job.staged() as stage:
        files = job.source.tokenizer_files()  # rebuilt (from a GGUF, llm.c's file) inside the stage
        size = stream_gguf(stage / FILE_NAME, items, job.source.config, encoding, files[0].parent, job.progress)
        job.write_manifest(stage, "gguf")
    return size


def stream_gguf(path: Path, items, config: GPTConfig, encoding: str, tokenizer_dir: Path, progress=None) -> int:
    """Write `items` [(key, dtype, shape, produce)] as a GPT-2 GGUF at `path`, each produce() called only when its
    bytes are due. Returns the file's size."""
    tied = GGUF.untied_head not in {key for key, *_ in items}
    plan = [(key, shape, storage_type(key, shape, encoding, config.n_layer, tied), produce)
            for key, _, shape, produce in items]
    return write_gguf(path, ARCH, plan, lambda writer: _describe(writer, config, encoding, tokenizer_dir), progress)


def _describe(writer: gguf.GGUFWriter, config: GPTConfig, encoding: str, tokenizer_dir: Path) -> None:
    """The metadata llama.cpp's gpt2 loader reads, and the tokenizer as its converter embeds GPT-2's."""
    writer.add_name("GPT-2")
    writer.add_block_count(config.n_layer)
    writer.add_context_length(config.n_positions)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(config.mlp_width)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    writer.add_file_type(RECIPES[encoding][0] if encoding in RECIPES else FILE_TYPES[ENCODINGS[encoding]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, merges, specials = bpe_tables(tokenizer_dir)
    if len(tokens) != config.vocab_size:
        raise GPT2PortError(f"{tokenizer_dir}: the tokenizer has {len(tokens)} tokens, the model {config.vocab_size}")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    special = set(specials)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([f"{a} {b}" for a, b in merges])
    eot = tokens.index(ENDOFTEXT)
    writer.add_bos_token_id(eot)  # GPT-2 has one special token, which serves as both
    writer.add_eos_token_id(eot)
    writer.add_add_bos_token(False)  # GPT-2 never prepends it to a prompt
