"""GGUF, llama.cpp's single-file format: a reader and a streaming writer, both through llama.cpp's own `gguf` package.

A GGUF file is a header, key/value metadata (the model's sizes, its tokenizer), tensor infos, then the aligned tensor
bytes. The writer declares every tensor first, writes the header, metadata and infos, then each tensor's bytes as it
is converted, so one tensor is in memory at a time. This module is imported only when a .gguf is read or written:
`gguf` costs ~0.3 s to import on top of torch, which `import gpt2port` and the CLI's --help should not pay.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch

from gpt2port.config import GPTConfig
from gpt2port.errors import GPT2PortError
from gpt2port.formats.base import Reader, TensorInfo, refuse_lfs_pointer
from gpt2port.formats.gguf_scan import check_structure
from gpt2port.fsio import os_reason
from gpt2port.outfile import open_append
from gpt2port.layouts.gguf import GGUF
from gpt2port.tokenizer import ENDOFTEXT, NO_TOKENIZER, bpe_tables

ARCH = "gpt2"
FILE_NAME = "model.gguf"  # the one file an export writes into its directory
Q = gguf.GGMLQuantizationType
# What --dtype means in a GGUF: the type of every matrix. Norms, biases and the position table stay F32 whatever
# is chosen, as llama.cpp's own converter keeps them (they are small, and the loader adds them in F32 anyway).
ENCODINGS = {"fp32": Q.F32, "fp16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}
KEEP_F32 = {GGUF.key_for("pos_emb.weight")}
FILE_TYPES = {Q.F32: gguf.LlamaFileType.ALL_F32, Q.F16: gguf.LlamaFileType.MOSTLY_F16,
              Q.BF16: gguf.LlamaFileType.MOSTLY_BF16, Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}
TORCH_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
OPTIONS = {"output_tensor"}  # output_tensor: also write the tied head as output.weight, for loaders that need it
_KEYS = gguf.Keys


def storage_type(key: str, shape: tuple[int, ...], encoding: str) -> Q:
    return Q.F32 if len(shape) == 1 or key in KEEP_F32 else ENCODINGS[encoding]


def _nbytes(shape: tuple[int, ...], qtype: Q) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


# --- reading ------------------------------------------------------------------------------------------------------

class _PackageReader(gguf.GGUFReader):
    """gguf.GGUFReader over a plain ndarray view of its memory map. Every slice of an np.memmap runs Python code,
    and a GPT-2 GGUF's metadata is ~250k small slices (50k tokens, 50k merges): ~40 s, against ~5 s this way."""

    @property
    def data(self):
        return self._plain

    @data.setter
    def data(self, value):
        self._plain = value.view(np.ndarray)  # the view keeps the map alive


_V = gguf.GGUFValueType
_INTEGERS = {_V.UINT8, _V.INT8, _V.UINT16, _V.INT16, _V.UINT32, _V.INT32, _V.UINT64, _V.INT64}
_REALS = _INTEGERS | {_V.FLOAT32, _V.FLOAT64}


def _whole(f, path: Path):
    """The whole file as a read-only buffer (mapped: nothing is read until walked)."""
    import mmap

    try:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (ValueError, OSError) as e:
        raise GPT2PortError(f"{path}: cannot be mapped for reading ({e})") from None


def _refuse_overlaps(path: Path, tensors) -> None:
    """Every tensor's bytes its own, as safetensors requires: two infos pointing at the same bytes are a damaged or
    crafted file, not a model (a write through one would change the other)."""
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors if t.nbytes)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise GPT2PortError(f"{path}: tensors {a!r} and {b!r} overlap (the bytes of {b!r} start at {start}, "
                                f"before those of {a!r} end at {end})")


class GGUFFileReader(Reader):
    """A GPT-2 GGUF (f32/f16/bf16 tensors): its tensors, the model's sizes and tokenizer from its metadata."""

    layout = GGUF.name
    config_keys = {k: v.format(arch=ARCH) for k, v in {  # config.json's names -> this file's
        "n_layer": _KEYS.LLM.BLOCK_COUNT, "n_head": _KEYS.Attention.HEAD_COUNT, "n_embd": _KEYS.LLM.EMBEDDING_LENGTH,
        "n_positions": _KEYS.LLM.CONTEXT_LENGTH, "n_inner": _KEYS.LLM.FEED_FORWARD_LENGTH,
        "layer_norm_epsilon": _KEYS.Attention.LAYERNORM_EPS}.items()}

    def __init__(self, path: Path):
        self.path = Path(path)
        self.files = [self.path]
        with open(self.path, "rb") as f:
            refuse_lfs_pointer(self.path, f.read(64))
            with _whole(f, self.path) as whole:
                check_structure(self.path, whole)
        try:
            self._gguf = _PackageReader(self.path)
        except Exception as e:  # the package raises ValueError, KeyError, IndexError... on a damaged file
            raise GPT2PortError(f"{self.path}: not a readable GGUF file (truncated or corrupt: "
                                f"{' '.join(str(e).split()) or type(e).__name__})") from None
        arch = self._field(_KEYS.General.ARCHITECTURE)
        if arch != ARCH:
            raise GPT2PortError(f"{self.path}: a GGUF of architecture {str(arch)[:60]!r}, not GPT-2 ({ARCH!r})")
        size = self.path.stat().st_size
        self.tensors, self._data = {}, {}
        for t in self._gguf.tensors:
            if t.tensor_type not in TORCH_TYPES:
                raise GPT2PortError(f"{self.path}: tensor {t.name!r} is quantized ({t.tensor_type.name}); gpt2port "
                                    f"imports F32, F16 and BF16 GGUF files only")
            if t.data_offset + t.n_bytes > size:
                raise GPT2PortError(f"{self.path}: truncated: tensor {t.name!r} ends at byte "
                                    f"{t.data_offset + t.n_bytes}, the file has {size}")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.tensors[t.name] = TensorInfo(t.name, TORCH_TYPES[t.tensor_type], shape, self.path,
                                              int(t.data_offset), int(t.n_bytes))
            self._data[t.name] = t.data
        _refuse_overlaps(self.path, self.tensors.values())
        self.metadata = {}
        self.warnings: list[str] = []
        self.model_config = self._model_config()

    def _field(self, key: str, required: bool = True):
        field = self._gguf.fields.get(key)
        if field is None:
            if required:
                raise GPT2PortError(f"{self.path}: GGUF metadata lacks {key!r}")
            return None
        try:
            return field.contents()
        except (UnicodeDecodeError, ValueError, IndexError):
            raise GPT2PortError(f"{self.path}: GGUF metadata {key!r} is damaged (not a readable value)") from None

    def _number(self, key: str, real: bool = False):
        """A size or eps from the metadata: one number (GPTConfig judges its value), or a refusal naming the key."""
        field = self._gguf.fields.get(key)
        kinds = _REALS if real else _INTEGERS
        if field is None or len(field.types) != 1 or field.types[0] not in kinds:
            self._field(key)  # names a missing key
            raise GPT2PortError(f"{self.path}: GGUF metadata {key!r} is not {'a number' if real else 'an integer'}")
        return field.contents()

    def _strings(self, key: str) -> list[str]:
        field = self._gguf.fields.get(key)
        if field is None or field.types != [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]:
            raise GPT2PortError(f"{self.path}: GGUF metadata {key!r} is not a list of strings")
        try:
            return field.contents()
        except UnicodeDecodeError:
            raise GPT2PortError(f"{self.path}: GGUF metadata {key!r} holds a string that is not UTF-8") from None

    def _model_config(self) -> dict:
        table = self.tensors.get(GGUF.key_for("tok_emb.weight"))
        if table is None:
            raise GPT2PortError(f"{self.path}: no {GGUF.key_for('tok_emb.weight')!r} tensor")
        embd = self._number(self.config_keys["n_embd"])
        ff = self._number(self.config_keys["n_inner"])
        eps = self._number(self.config_keys["layer_norm_epsilon"], real=True)
        return {
            "model_type": "gpt2",
            "n_layer": self._number(self.config_keys["n_layer"]),
            "n_head": self._number(self.config_keys["n_head"]),
            "n_embd": embd,
            "n_positions": self._number(self.config_keys["n_positions"]),
            "n_inner": None if ff == 4 * embd else ff,  # as config.json says it for every official GPT-2
            # Stored as float32: its shortest decimal gives back the 1e-5 that was written, not 9.99999974e-06.
            "layer_norm_epsilon": float(str(np.float32(eps))),
            "vocab_size": table.shape[0],
        }

    def read(self, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        info = self.tensors[name]
        raw = torch.empty(info.nbytes, dtype=torch.uint8) if into is None else into[: info.nbytes]
        try:  # a copy out of the package's memory map, so the result outlives the reader
            raw.numpy()[:] = np.asarray(self._data[name]).reshape(-1).view(np.uint8)
        except (OSError, ValueError) as e:
            raise GPT2PortError(f"{self.path}: reading tensor {name!r} failed: {e}") from None
        return raw.view(info.dtype).reshape(info.shape)

    def _read_tokenizer(self) -> tuple[list, list] | None:
        """The embedded tokenizer (see Reader.tokenizer_files); None, with a warning, where the file carries none."""
        model = self._field(_KEYS.Tokenizer.MODEL, required=False)
        if model is None:  # the weights are usable; GPT-2's tokenizer can be put beside them (as for every format)
            self.warnings.append(f"{self.path}: no embedded tokenizer (no {_KEYS.Tokenizer.MODEL!r} in its "
                                 f"metadata); {NO_TOKENIZER}")
            return None
        if model != "gpt2":  # token ids of another vocabulary: GPT-2's tokenizer would not fit these weights
            raise GPT2PortError(f"{self.path}: embedded tokenizer is {str(model)[:60]!r}, not GPT-2's byte-level BPE")
        tokens = self._strings(_KEYS.Tokenizer.LIST)
        merges = [tuple(m.split(" ")) for m in self._strings(_KEYS.Tokenizer.MERGES)]
        if any(len(m) != 2 for m in merges):
            raise GPT2PortError(f"{self.path}: a tokenizer merge is not an 'a b' pair")
        return tokens, merges

    def close(self) -> None:
        self._data, self._gguf = {}, None  # drop the memory map
        super().close()


# --- writing ------------------------------------------------------------------------------------------------------

def _describe(writer: gguf.GGUFWriter, config: GPTConfig, encoding: str, tokenizer_dir: Path) -> None:
    """The metadata llama.cpp's gpt2 loader reads, and the tokenizer as its converter embeds GPT-2's."""
    writer.add_name("GPT-2")
    writer.add_block_count(config.n_layer)
    writer.add_context_length(config.n_positions)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(config.mlp_width)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    writer.add_file_type(FILE_TYPES[ENCODINGS[encoding]])
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


def _encode(tensor: torch.Tensor, qtype: Q) -> np.ndarray:
    if qtype == Q.Q8_0:
        return gguf.quants.quantize(tensor.float().contiguous().numpy(), qtype)
    t = tensor.to(TORCH_TYPES[qtype]).contiguous()
    # numpy has no bfloat16: its bytes go as uint16, which the writer takes for raw_dtype=BF16 as they are.
    return t.view(torch.int16).numpy().view(np.uint16) if qtype == Q.BF16 else t.numpy()


def stream_gguf(path: Path, items, config: GPTConfig, encoding: str, tokenizer_dir: Path, progress=None) -> int:
    """Write `items` [(key, dtype, shape, produce)] as a GPT-2 GGUF at `path`, each produce() called only when its
    bytes are due. Returns the file's size."""
    plan = [(key, shape, storage_type(key, shape, encoding), produce) for key, _, shape, produce in items]
    for key, shape, qtype, _ in plan:
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if shape[-1] % block:
            raise GPT2PortError(f"{path.parent}: {encoding} needs rows whose length divides by {block}; "
                                f"{key} has rows of {shape[-1]}")
    writer = gguf.GGUFWriter(path, ARCH)
    try:
        out = open_append(path)
    except OSError as e:
        raise GPT2PortError(f"{path}: cannot create: {os_reason(e)}") from None
    try:
        _describe(writer, config, encoding, tokenizer_dir)
        for key, shape, qtype, _ in plan:
            writer.add_tensor_info(key, shape, _numpy_dtype(qtype), _nbytes(shape, qtype), qtype)
        # The gguf writer writes through whatever file object it holds once described: ours, so that the weights go
        # out as every large output does (gpt2port/outfile.py). Its own open would also log a plan of the file.
        writer.fout, writer.state = [out], gguf.WriterState.EMPTY
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        total, done = sum(_nbytes(s, q) for _, s, q, _ in plan), 0
        for key, shape, qtype, produce in plan:
            writer.write_tensor_data(_encode(produce(), qtype).view(_Raw))
            done += _nbytes(shape, qtype)
            if progress:
                progress(done, total)
        written = out.tell()
        out.close()
    except OSError as e:
        raise GPT2PortError(f"{path}: write failed: {os_reason(e)}") from None
    finally:
        out.abort()  # after close() above this does nothing; on a failure it stops the writer and closes the file
        writer.fout = None
    # Re-parsing the metadata would cost seconds; every byte went through the file object, so its length says all.
    if path.stat().st_size != written:
        raise GPT2PortError(f"{path}: post-write check failed: {path.stat().st_size} bytes on disk, {written} written")
    return written


class _Raw(np.ndarray):
    """A tensor's bytes for the gguf writer, which hands each tensor to ndarray.tofile: numpy's tofile wants an OS
    file, and the writer holds an outfile appender, so the bytes are handed to its write() instead."""

    def tofile(self, fid, *args, **kwargs) -> None:
        fid.write(memoryview(np.ascontiguousarray(self.view(np.ndarray))).cast("B"))


def _numpy_dtype(qtype: Q) -> np.dtype:
    return np.dtype({Q.F32: np.float32, Q.F16: np.float16, Q.BF16: np.uint16, Q.Q8_0: np.float32}[qtype])
