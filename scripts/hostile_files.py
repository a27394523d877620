"""Tiny valid files of every format gpt2port reads, written here byte by byte where the format's own library would
hide what a hostile file can say: the seeds that scripts/fuzz.py mutates and tests/formats/test_hostile.py bends.

One tiny GPT-2 (1 layer, width 8, 2 heads, 8 positions, a 320-token byte-level BPE: GPT-2's own first 63 merges) in:
  safetensors/   Hugging Face's layout: model.safetensors + config.json + tokenizer
  shards/        the same in two shards + model.safetensors.index.json
  pickle/        pytorch_model.bin (zip pickle) + config.json
  nanogpt/       ckpt.pt: nanoGPT's training checkpoint ("model" + "model_args")
  tf/            OpenAI's TensorFlow release layout: model.ckpt.index + model.ckpt.data-00000-of-00001 + hparams.json
  llmc/          llm.c's gpt2_124M.bin (+ its tokenizer file)
  gguf/          model.gguf with its sizes and tokenizer in the metadata
  gpt2port/      a gpt2port checkpoint (model.safetensors, config.json, manifest.json, tokenizer)
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import torch

from gpt2port.config import GPTConfig
from gpt2port.layouts import canonical

MERGES = 63
CONFIG = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=256 + MERGES + 1, n_positions=8)
FORMATS = ("safetensors", "shards", "pickle", "nanogpt", "tf", "llmc", "gguf", "gpt2port")


def tokenizer(out: Path) -> tuple[list[str], list[str]]:
    """vocab.json + merges.txt of a small genuine byte-level BPE: GPT-2's 256 byte tokens, its first MERGES merges
    (ids 256..), then <|endoftext|>. Returns (tokens by id, merges as 'a b')."""
    from scripts.hf_fixtures import tokenizer_files

    files = tokenizer_files()
    vocab = json.loads(files["vocab.json"].read_text(encoding="utf-8"))
    merges = files["merges.txt"].read_text(encoding="utf-8").split("\n")[1 : 1 + MERGES]
    tokens = sorted((t for t, i in vocab.items() if i < 256 + MERGES), key=vocab.get) + ["<|endoftext|>"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}, ensure_ascii=False),
                                    encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(m + "\n" for m in merges), encoding="utf-8")
    return tokens, merges


def canonical_state(config: GPTConfig = CONFIG, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) * 0.2 for k, s in canonical.shapes(config).items()}


def layout_state(layout, state: dict, config: GPTConfig = CONFIG) -> dict[str, torch.Tensor]:
    """`state` (canonical) under a layout's names and shapes, as that layout's writer would store it."""
    return {w.key: w.transform.to_layout(state[w.source]).contiguous() for w in layout.plan_write(config)}


# --- GGUF, written by hand so that any count or offset can be what a test wants ---------------------------------

U32, F32, STRING, ARRAY = 4, 6, 8, 9


def gguf_metadata(config: GPTConfig = CONFIG, tokens: list[str] | None = None, merges: list[str] | None = None) -> list:
    kv = [("general.architecture", STRING, "gpt2"), ("gpt2.block_count", U32, config.n_layer),
          ("gpt2.context_length", U32, config.n_positions), ("gpt2.embedding_length", U32, config.n_embd),
          ("gpt2.feed_forward_length", U32, config.mlp_width), ("gpt2.attention.head_count", U32, config.n_head),
          ("gpt2.attention.layer_norm_epsilon", F32, config.layer_norm_epsilon)]
    if tokens is not None:
        kv += [("tokenizer.ggml.model", STRING, "gpt2"), ("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)),
               ("tokenizer.ggml.merges", ARRAY, (STRING, merges))]
    return kv


def _gguf_string(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _gguf_value(kind: int, value) -> bytes:
    if kind == U32:
        return struct.pack("<I", value)
    if kind == F32:
        return struct.pack("<f", value)
    if kind == STRING:
        return _gguf_string(value)
    if isinstance(value, bytes):  # an array's bytes as a test wants them (a count its items do not bear out)
        return value
    item, items = value
    return struct.pack("<IQ", item, len(items)) + b"".join(_gguf_value(item, v) for v in items)


def gguf_offsets(tensors: dict[str, np.ndarray], alignment: int = 32) -> dict[str, int]:
    """Where each F32 tensor's bytes start, from the start of the data section, each aligned."""
    out, at = {}, 0
    for name, t in tensors.items():
        at += -at % alignment
        out[name] = at
        at += t.size * 4
    return out


def write_gguf(path: Path, metadata: list, tensors: dict[str, np.ndarray], offsets: dict[str, int] | None = None,
               alignment: int = 32) -> list[tuple[int, int]]:
    """A GGUF v3 of `metadata` [(key, type, value)] and F32 `tensors`; `offsets` overrides where an info says a
    tensor's bytes are. Returns the (position, size) of every count and length field, for a fuzzer to enlarge."""
    counts, out = [(8, 8), (16, 8)], bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)))

    def note(b: bytes, fields: list[int]) -> None:  # fields: positions in b of u64 counts/lengths
        counts.extend((len(out) + f, 8) for f in fields)
        out.extend(b)
    for key, kind, value in metadata:
        note(_gguf_string(key) + struct.pack("<I", kind), [0])
        v = _gguf_value(kind, value)
        fields = [0] if kind == STRING else [4] if kind == ARRAY else []
        if kind == ARRAY and not isinstance(value, bytes) and value[0] == STRING:
            pos = 12
            for s in value[1]:
                fields.append(pos)
                pos += 8 + len(s.encode("utf-8"))
        note(v, fields)
    placed, data = gguf_offsets(tensors, alignment), bytearray()
    for name, t in tensors.items():
        data.extend(b"\0" * (placed[name] - len(data)))
        data.extend(np.ascontiguousarray(t, dtype=np.float32).tobytes())
    for name, t in tensors.items():
        info = _gguf_string(name) + struct.pack("<I", t.ndim) + struct.pack(f"<{t.ndim}Q", *reversed(t.shape))
        note(info + struct.pack("<IQ", 0, (offsets or {}).get(name, placed[name])), [0, 8 + len(name.encode()) + 4])
    out.extend(b"\0" * (-len(out) % alignment))
    Path(path).write_bytes(bytes(out) + bytes(data))
    return counts


# --- TensorFlow's tensor bundle: an SSTable of protobuf entries, checksummed -------------------------------------

def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def proto(*fields: tuple[int, int, int | bytes]) -> bytes:
    """A protobuf message of (number, wire type, value) fields: wire 0 varint, 2 bytes, 5 fixed32."""
    out = bytearray()
    for number, wire, value in fields:
        out += varint(number << 3 | wire)
        out += varint(value) if wire == 0 else varint(len(value)) + value if wire == 2 else struct.pack("<I", value)
    return bytes(out)


def tf_entry(shape: tuple[int, ...], offset: int, size: int, crc: int, shard: int = 0, dtype: int = 1) -> bytes:
    dims = b"".join(proto((2, 2, proto((1, 0, d)))) for d in shape)
    return proto((1, 0, dtype), (2, 2, dims), *([(3, 0, shard)] if shard else []), (4, 0, offset), (5, 0, size),
                 (6, 5, crc))


def tf_header(num_shards: int = 1) -> bytes:
    return proto((1, 0, num_shards), (3, 2, proto((1, 0, 1))))  # num_shards, version {producer 1}


def write_sstable(path: Path, table: dict[bytes, bytes]) -> None:
    """One data block of every entry (sorted, no prefix sharing), an empty metaindex, an index, the footer."""
    from gpt2port.formats.tf_bundle import TABLE_MAGIC, masked_crc32c

    def block(entries) -> bytes:
        body = b"".join(varint(0) + varint(len(k)) + varint(len(v)) + k + v for k, v in entries)
        body += struct.pack("<II", 0, 1)  # one restart point, at 0
        return body + b"\0" + struct.pack("<I", masked_crc32c(body + b"\0"))
    items = sorted(table.items())
    data = block(items)
    meta_at, meta = len(data), block([])
    index_at = meta_at + len(meta)
    index = block([(items[-1][0] if items else b"", varint(0) + varint(len(data) - 5))])
    handles = varint(meta_at) + varint(len(meta) - 5) + varint(index_at) + varint(len(index) - 5)
    footer = handles + b"\0" * (40 - len(handles)) + struct.pack("<Q", TABLE_MAGIC)
    Path(path).write_bytes(data + meta + index + footer)


def write_tf(directory: Path, tensors: dict[str, np.ndarray], header: bytes | None = None,
             entries: dict[str, bytes] | None = None) -> None:
    """A one-shard bundle of F32 `tensors`; `header` and `entries` (name -> BundleEntryProto bytes) replace what
    would be written."""
    from gpt2port.formats.tf_bundle import masked_crc32c

    directory.mkdir(parents=True, exist_ok=True)
    blob, table = bytearray(), {b"": tf_header() if header is None else header}
    for name, t in tensors.items():
        raw = np.ascontiguousarray(t, dtype=np.float32).tobytes()
        table[name.encode()] = tf_entry(t.shape, len(blob), len(raw), masked_crc32c(raw))
        blob += raw
    table.update({k.encode(): v for k, v in (entries or {}).items()})
    (directory / "model.ckpt.data-00000-of-00001").write_bytes(bytes(blob))
    write_sstable(directory / "model.ckpt.index", table)


def hparams(config: GPTConfig = CONFIG) -> dict:
    return {"n_vocab": config.vocab_size, "n_ctx": config.n_positions, "n_embd": config.n_embd,
            "n_head": config.n_head, "n_layer": config.n_layer}


# --- every format ---------------------------------------------------------------------------------------------------

def build(root: Path, formats=FORMATS, seed: int = 0) -> dict[str, Path]:
    """Each format's seed under root/FORMAT; returns format -> what a command is pointed at."""
    from safetensors.torch import save_file

    from gpt2port.checkpoint import save_state
    from gpt2port.conversion import convert, export
    from gpt2port.layouts import GGUF, HF
    from gpt2port.layouts.nanogpt import NANOGPT
    from gpt2port.layouts.openai_tf import OPENAI_TF

    root = Path(root)
    tok = root / "_tokenizer"
    tokens, merges = tokenizer(tok)
    state = canonical_state(seed=seed)
    saved = root / "_saved"
    save_state(state, CONFIG, saved, tokenizer_from=tok)
    hf = root / "safetensors"
    export(saved, hf, to="hf")
    ckpt = root / "gpt2port"  # converted, so that its manifest records a source and its files
    convert(hf, ckpt)
    shutil.rmtree(saved)
    hf_state = layout_state(HF, state)
    out = {"gpt2port": ckpt, "safetensors": hf}
    if "shards" in formats:
        d = root / "shards"
        d.mkdir()
        names = list(hf_state)
        weight_map = {}
        for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
            shard = f"model-0000{i + 1}-of-00002.safetensors"
            save_file({k: hf_state[k] for k in part}, str(d / shard), {"format": "pt"})
            weight_map.update({k: shard for k in part})
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        _side_files(hf, d)
        out["shards"] = d
    if "pickle" in formats:
        d = root / "pickle"
        d.mkdir()
        torch.save(hf_state, d / "pytorch_model.bin")
        _side_files(hf, d)
        out["pickle"] = d
    if "nanogpt" in formats:
        d = root / "nanogpt"
        d.mkdir()
        args = {"n_layer": CONFIG.n_layer, "n_head": CONFIG.n_head, "n_embd": CONFIG.n_embd, "bias": True,
                "block_size": CONFIG.n_positions, "vocab_size": CONFIG.vocab_size, "dropout": 0.0}
        torch.save({"model": layout_state(NANOGPT, state), "model_args": args, "iter_num": 1}, d / "ckpt.pt")
        _side_files(hf, d, config=False)
        out["nanogpt"] = d / "ckpt.pt"
    if "tf" in formats:
        d = root / "tf"
        write_tf(d, {k: v.numpy() for k, v in layout_state(OPENAI_TF, state).items()})
        (d / "hparams.json").write_text(json.dumps(hparams()))
        out["tf"] = d
    if "llmc" in formats:
        export(ckpt, root / "llmc", to="llmc")
        out["llmc"] = next((root / "llmc").glob("gpt2_*.bin"))
    if "gguf" in formats:
        d = root / "gguf"
        d.mkdir()
        write_gguf(d / "model.gguf", gguf_metadata(tokens=tokens, merges=merges),
                   {k: v.numpy() for k, v in layout_state(GGUF, state).items()})
        out["gguf"] = d / "model.gguf"
    shutil.rmtree(tok)
    return {k: v for k, v in out.items() if k in formats}


def _side_files(hf: Path, d: Path, config: bool = True) -> None:
    for name in (["config.json"] if config else []) + ["vocab.json", "merges.txt"]:
        shutil.copyfile(hf / name, d / name)
