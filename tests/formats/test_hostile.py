"""Hostile and impossible files (issue 32, items 4-8 and 12): each tiny file is refused in one line naming the file,
key or argument at fault, within a memory cap and a time limit, in a fresh process (a hang or a runaway allocation
fails the test instead of the machine).

The seeds are scripts/hostile_files.py's tiny valid files; each test bends one of them the way the issue found.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts import hostile_files as hf
from tests.support import assert_one_line_error, snapshot
from tests.support import ROOT

MEMORY = 1 << 30  # address space of the whole process, torch's ~0.65 GB included
TIMEOUT = 30  # the work is bounded by the file's few KB; this turns a hang into a failure on a busy machine


def capped(*args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m gpt2port ARGS` in a fresh process with MEMORY of address space and TIMEOUT seconds."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    try:
        return subprocess.run([sys.executable, "-m", "gpt2port", *map(str, args)], capture_output=True, text=True,
                              env=env, cwd=cwd, timeout=TIMEOUT, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"gpt2port {' '.join(map(str, args))}: no answer within {TIMEOUT} s (a hang)")


def refused(*args, names=(), cwd: Path | None = None) -> str:
    r = capped(*args, cwd=cwd)
    return assert_one_line_error(r.returncode, r.stderr, r.stdout, names)


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, Path]:
    return hf.build(tmp_path_factory.mktemp("seeds"))


@pytest.fixture(scope="module")
def gguf_meta(tmp_path_factory) -> list:
    """A valid GGUF's metadata: the tiny model's sizes and its tokenizer."""
    tokens, merges = hf.tokenizer(tmp_path_factory.mktemp("tokenizer"))
    return hf.gguf_metadata(tokens=tokens, merges=merges)


def copy_of(seeds, fmt: str, tmp_path: Path) -> Path:
    src = seeds[fmt]
    root = src if src.is_dir() else src.parent
    shutil.copytree(root, tmp_path / fmt)
    return tmp_path / fmt if src.is_dir() else tmp_path / fmt / src.name


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    target = data["model"] if "model" in data else data
    target.update(changes)
    path.write_text(json.dumps(data))


def tiny_tensors(layout) -> dict:
    return {k: v.numpy() for k, v in hf.layout_state(layout, hf.canonical_state()).items()}


# --- 4. GGUF counts the file cannot hold ------------------------------------------------------------------------------

HUGE_ARRAY = struct.pack("<IQ", 0, 2**62) + b"\0" * 11  # 2**62 u8 items, 11 bytes of them present


@pytest.mark.parametrize("where", ["alone", "in a valid model"])
def test_gguf_array_of_2_62_items_is_refused_at_once(tmp_path, gguf_meta, where):
    from gpt2port.layouts import GGUF

    path = tmp_path / "src" / "evil.gguf"
    path.parent.mkdir()
    if where == "alone":  # 60 bytes: the header, one key, an array header claiming 2**62 bytes
        path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a"
                         + struct.pack("<I", hf.ARRAY) + HUGE_ARRAY)
        assert path.stat().st_size == 60
    else:
        hf.write_gguf(path, gguf_meta + [("evil", hf.ARRAY, HUGE_ARRAY)], tiny_tensors(GGUF))
    line = refused("convert", path, "--out", tmp_path / "out", names=[path])
    assert "4,611,686,018,427,387,904" in line, line
    assert not (tmp_path / "out").exists()


# --- 5. TensorFlow index headers and entries that lie -----------------------------------------------------------------

def test_tf_index_claiming_a_billion_shards(tmp_path):
    from gpt2port.layouts.openai_tf import OPENAI_TF

    d = tmp_path / "tf"
    hf.write_tf(d, tiny_tensors(OPENAI_TF), header=hf.tf_header(10**9))
    (d / "hparams.json").write_text(json.dumps(hf.hparams()))
    refused("convert", d, "--out", tmp_path / "out", names=["model.ckpt.index", "1000000000"])


def test_tf_dimension_stored_as_bytes(tmp_path):
    from gpt2port.layouts.openai_tf import OPENAI_TF

    d = tmp_path / "tf"
    dims = hf.proto((2, 2, hf.proto((1, 2, b"\x01" * 1000)))) + hf.proto((2, 2, hf.proto((1, 0, 10**6))))
    entry = hf.proto((1, 0, 1), (2, 2, dims), (4, 0, 0), (5, 0, 4))
    hf.write_tf(d, tiny_tensors(OPENAI_TF), entries={"model/wte": entry})
    (d / "hparams.json").write_text(json.dumps(hf.hparams()))
    refused("convert", d, "--out", tmp_path / "out", names=["model.ckpt.index", "model/wte"])


# --- 6. a gpt2port config.json claiming 10**9 layers -----------------------------------------------------------------

@pytest.mark.parametrize("command", ["info", "generate", "verify", "finetune"])
def test_config_json_claiming_a_billion_layers(seeds, tmp_path, command):
    ckpt = copy_of(seeds, "gpt2port", tmp_path)
    edit_json(ckpt / "config.json", n_layer=10**9)
    data = tmp_path / "data.txt"
    data.write_text("hello world " * 50)
    args = {"info": [ckpt], "generate": [ckpt, "hi", "-n", "1", "--device", "cpu"],
            "verify": [ckpt, "--reference", seeds["safetensors"], "--no-hf", "--tokens", "4"],
            "finetune": [ckpt, "--data", data, "--out", tmp_path / "run", "--steps", "1", "--device", "cpu"]}[command]
    line = refused(command, *args, names=[ckpt / "config.json"])
    assert "1,000,000,000" in line or "parameters" in line, line


# --- 7. sizes from every source: one validation, naming the file and the key as it spells it ------------------------

def _tf_with(tmp_path, **hp):
    from gpt2port.layouts.openai_tf import OPENAI_TF

    d = tmp_path / "tf"
    hf.write_tf(d, tiny_tensors(OPENAI_TF))
    (d / "hparams.json").write_text(json.dumps({**hf.hparams(), **hp}))
    return ["convert", d, "--out", tmp_path / "out"], [d / "hparams.json"]


def _gguf_with(tmp_path, meta, key, kind, value):
    from gpt2port.layouts import GGUF

    path = tmp_path / "src" / "model.gguf"
    path.parent.mkdir()
    meta = [(k, kind, value) if k == key else (k, t, v) for k, t, v in meta]
    hf.write_gguf(path, meta, tiny_tensors(GGUF))
    return ["convert", path, "--out", tmp_path / "out"], [path, key]


def _nanogpt_with(seeds, tmp_path, **args):
    path = copy_of(seeds, "nanogpt", tmp_path)
    ckpt = torch.load(path, weights_only=True)
    ckpt["model_args"].update(args)
    torch.save(ckpt, path)
    return ["convert", path, "--out", tmp_path / "out"], [path, f"model_args.{next(iter(args))}"]


def _gpt2port_with(seeds, tmp_path, **model):
    ckpt = copy_of(seeds, "gpt2port", tmp_path)
    edit_json(ckpt / "config.json", **model)
    return ["info", ckpt], [ckpt / "config.json", f"model.{next(iter(model))}"]


SIZE_CASES = {
    "hparams n_head 0": lambda s, t, m: _tf_with(t, n_head=0),
    "hparams n_layer 1.5": lambda s, t, m: _tf_with(t, n_layer=1.5),
    "gguf head_count 0": lambda s, t, m: _gguf_with(t, m, "gpt2.attention.head_count", hf.U32, 0),
    "gguf eps NaN": lambda s, t, m: _gguf_with(t, m, "gpt2.attention.layer_norm_epsilon", hf.F32, float("nan")),
    "nanoGPT n_head -4": lambda s, t, m: _nanogpt_with(s, t, n_head=-4),
    "nanoGPT n_layer 1.5": lambda s, t, m: _nanogpt_with(s, t, n_layer=1.5),
    "config.json n_head -4": lambda s, t, m: _gpt2port_with(s, t, n_head=-4),
    "config.json eps -1": lambda s, t, m: _gpt2port_with(s, t, layer_norm_epsilon=-1.0),
    "config.json dropout 1.5": lambda s, t, m: _gpt2port_with(s, t, dropout=1.5),
}


@pytest.mark.parametrize("case", list(SIZE_CASES))
def test_impossible_sizes_are_refused_naming_file_and_key(seeds, tmp_path, gguf_meta, case):
    args, names = SIZE_CASES[case](seeds, tmp_path, gguf_meta)
    refused(*args, names=names)
    assert not (tmp_path / "out").exists()


# --- 8. inputs that ended in "internal error" -------------------------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


def _deep_config(seeds, t):
    d = copy_of(seeds, "safetensors", t)
    (d / "config.json").write_text(DEEP)
    return ["convert", d, "--out", t / "out"], [d / "config.json"]


def _deep_index(seeds, t):
    d = copy_of(seeds, "shards", t)
    (d / "model.safetensors.index.json").write_text('{"weight_map": ' + DEEP + "}")
    return ["convert", d, "--out", t / "out"], [d / "model.safetensors.index.json"]


def _deep_manifest(seeds, t):
    d = copy_of(seeds, "gpt2port", t)
    (d / "manifest.json").write_text(DEEP)
    return ["info", d], [d / "manifest.json"]


def _deep_jsonl(seeds, t):
    data = t / "data.jsonl"
    data.write_text('{"text": "hello"}\n' + DEEP + "\n")
    return ["finetune", seeds["gpt2port"], "--data", data, "--out", t / "run", "--steps", "1", "--device", "cpu"], \
        [data]


def _long_int_header(seeds, t):
    d = copy_of(seeds, "safetensors", t)
    raw = (d / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n].decode().replace('"data_offsets":[0,', '"data_offsets":[' + "9" * 5000 + ",", 1)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode() + raw[8 + n :])
    return ["convert", d, "--out", t / "out"], [d / "model.safetensors"]


def _indexes_naming_each_other(seeds, t):
    d = t / "loop"
    d.mkdir()
    (d / "a.safetensors.index.json").write_text(json.dumps({"weight_map": {"wte.weight": "b.safetensors.index.json"}}))
    (d / "b.safetensors.index.json").write_text(json.dumps({"weight_map": {"wte.weight": "a.safetensors.index.json"}}))
    return ["convert", d / "a.safetensors.index.json", "--out", t / "out"], [d / "a.safetensors.index.json"]


def _tf_header(header: bytes):
    def make(seeds, t):
        from gpt2port.layouts.openai_tf import OPENAI_TF

        d = t / "tf"
        hf.write_tf(d, tiny_tensors(OPENAI_TF), header=header)
        (d / "hparams.json").write_text(json.dumps(hf.hparams()))
        return ["convert", d, "--out", t / "out"], [d / "model.ckpt.index"]
    return make


def _sparse_pickle(seeds, t):
    d = copy_of(seeds, "pickle", t)
    sd = torch.load(d / "pytorch_model.bin", weights_only=True)
    proj = next(k for k in sd if k.endswith("h.0.attn.c_proj.weight"))
    sd[proj] = sd[proj].to_sparse()
    torch.save(sd, d / "pytorch_model.bin")
    return ["convert", d, "--out", t / "out"], [d / "pytorch_model.bin"]


def _stride_0_pickle(seeds, t):
    """A model of 2**20 x 2**14 embeddings (64 GB, and 4 GB per MLP matrix) whose every tensor is one stored number
    repeated by strides of 0: 15 KB on disk, and a config.json that agrees with every shape."""
    from gpt2port.config import GPTConfig
    from gpt2port.layouts import HF

    d = copy_of(seeds, "pickle", t)
    config = GPTConfig(n_layer=1, n_head=2, n_embd=2**14, vocab_size=2**20, n_positions=8)
    sd = {w.key: torch.zeros(1).expand(w.shape) for w in HF.plan_write(config)}
    torch.save(sd, d / "pytorch_model.bin")
    (d / "config.json").write_text(json.dumps(config.to_hf_config()))
    return ["convert", d, "--out", t / "out"], [d / "pytorch_model.bin"]


def _symlink_loop(seeds, t):
    (t / "loop").symlink_to("loop")
    return ["convert", seeds["safetensors"], "--out", t / "loop"], [t / "loop"]


INTERNAL_ERROR_CASES = {
    "config.json nested 100k deep": _deep_config,
    "shard index nested 100k deep": _deep_index,
    "manifest.json nested 100k deep": _deep_manifest,
    "jsonl data nested 100k deep": _deep_jsonl,
    "5000-digit integer in a header": _long_int_header,
    "two shard indexes naming each other": _indexes_naming_each_other,
    "TF header wire type 3": _tf_header(bytes([1 << 3 | 3])),
    "TF header num_shards 0": _tf_header(hf.proto((1, 0, 0))),
    "sparse tensor in a pickle": _sparse_pickle,
    "stride-0 tensors in a pickle": _stride_0_pickle,
    "symlink loop as --out": _symlink_loop,
    "--device bogus": lambda s, t: (["generate", s["gpt2port"], "hi", "--device", "bogus"], ["--device bogus"]),
    "--temperature nan": lambda s, t: (["generate", s["gpt2port"], "hi", "--temperature", "nan"], ["--temperature"]),
}


@pytest.mark.parametrize("case", list(INTERNAL_ERROR_CASES))
def test_hostile_inputs_get_a_one_line_refusal(seeds, tmp_path, case):
    args, names = INTERNAL_ERROR_CASES[case](seeds, tmp_path)
    before = snapshot(tmp_path)
    line = refused(*args, names=names)
    assert "internal error" not in line
    assert snapshot(tmp_path) == before  # nothing written, nothing changed


# --- 12b/c. GGUF: overlapping tensors, and no embedded tokenizer ------------------------------------------------------

def test_gguf_tensors_at_overlapping_offsets_are_refused(tmp_path, gguf_meta):
    from gpt2port.layouts import GGUF

    tensors = tiny_tensors(GGUF)
    path = tmp_path / "src" / "model.gguf"
    path.parent.mkdir()
    offsets = hf.gguf_offsets(tensors)
    offsets["blk.0.attn_norm.bias"] = offsets["blk.0.attn_norm.weight"]  # one info pointing into another's bytes
    hf.write_gguf(path, gguf_meta, tensors, offsets=offsets)
    refused("convert", path, "--out", tmp_path / "out", names=[path, "blk.0.attn_norm.bias", "overlap"])


def _info_at(data: bytearray, name: str) -> int:
    """Where tensor `name`'s info continues after its name (at its rank)."""
    raw = name.encode()
    return data.index(struct.pack("<Q", len(raw)) + raw) + 8 + len(raw)


def _retyped(data: bytearray) -> None:
    at = _info_at(data, "blk.0.ffn_up.weight")
    (rank,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * rank, 99)


def _renamed(data: bytearray) -> None:
    at = _info_at(data, "blk.0.ffn_norm.bias") - len("blk.0.ffn_norm.bias")
    data[at : at + 19] = b"blk.0.ffn_up.weight"  # a name of the same length


def _replaced(key: str, kind: int, make):
    return lambda meta: [(k, kind, make(v)) if k == key else (k, t, v) for k, t, v in meta]


def _added(*entries):
    return lambda meta: meta + list(entries)


GGUF_HEADER_CASES = {  # metadata changed, bytes bent (or None), the words the refusal holds
    "key twice": (_added(("gpt2.block_count", hf.U32, 2)), None, ["'gpt2.block_count' appears twice"]),
    "key not UTF-8": (_added((b"gpt2.\xff", hf.U32, 2)), None, ["'s key is not UTF-8"]),
    "alignment 48": (_added(("general.alignment", hf.U32, 48)), None, ["'general.alignment' is not a power of two"]),
    "tensor twice": (_added(), _renamed, ["tensor 'blk.0.ffn_up.weight' appears twice"]),
    "unknown tensor type": (_added(), _retyped, ["'blk.0.ffn_up.weight' has an unknown GGML type (99)"]),
    "architecture not a string": (_replaced("general.architecture", hf.ARRAY, lambda v: (hf.U32, [1, 2])), None,
                                  ["'general.architecture' is not a string"]),
    "a token more than rows": (_replaced("tokenizer.ggml.tokens", hf.ARRAY, lambda v: (hf.STRING, [*v[1], "x"])),
                               None, ["'tokenizer.ggml.tokens' lists", "can belong to this model"]),
}


@pytest.mark.parametrize("case", list(GGUF_HEADER_CASES))
def test_gguf_metadata_that_cannot_be_a_model_is_refused_naming_what(tmp_path, gguf_meta, case):
    from gpt2port.layouts import GGUF

    meta, bend, words = GGUF_HEADER_CASES[case]
    path = tmp_path / "src" / "model.gguf"
    path.parent.mkdir()
    hf.write_gguf(path, meta(gguf_meta), tiny_tensors(GGUF))
    if bend:
        data = bytearray(path.read_bytes())
        bend(data)
        path.write_bytes(data)
    before = snapshot(tmp_path)
    refused("convert", path, "--out", tmp_path / "out", names=[path, *words])
    assert snapshot(tmp_path) == before


def test_gguf_without_a_tokenizer_converts_with_a_warning(tmp_path):
    from gpt2port.layouts import GGUF

    path = tmp_path / "src" / "model.gguf"
    path.parent.mkdir()
    hf.write_gguf(path, hf.gguf_metadata(), tiny_tensors(GGUF))
    r = capped("convert", path, "--out", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    warning = r.stderr.strip()
    assert warning.startswith("warning: ") and "\n" not in warning, r.stderr
    assert str(path) in warning and "tokenizer.ggml.model" in warning, warning
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert any("tokenizer.ggml.model" in w for w in manifest["warnings"])
    assert not (tmp_path / "out" / "vocab.json").exists()


# --- the fuzz script itself -------------------------------------------------------------------------------------------

def test_fuzz_script_runs_and_finds_nothing(tmp_path):
    report = tmp_path / "fuzz.json"
    r = subprocess.run([sys.executable, "-m", "scripts.fuzz", "--cases", "20", "--seed", "7", "--json", report,
                        "--work", tmp_path / "work"], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    facts = json.loads(report.read_text())
    assert facts["cases"] == 20 and facts["failures"] == [], facts["failures"]
    assert len(facts["formats"]) >= 8 and facts["formats"]["ownership"] == 4  # what --force must leave alone
    assert facts["formats"].get("run-state", 0) >= 2  # a fine-tuning run's state (scripts/fuzz_state.py)
    assert facts["formats"].get("eval-data", 0) >= 1 and facts["formats"].get("adapter", 0) >= 1  # fuzz_inputs.py


def test_fuzz_of_eval_data_and_adapters_finds_nothing(tmp_path):
    """Hostile eval jsonl and LoRA adapters (scripts/fuzz_inputs.py), a few cases of each in the default run."""
    report = tmp_path / "fuzz.json"
    r = subprocess.run([sys.executable, "-m", "scripts.fuzz", "--cases", "8", "--seed", "11", "--formats",
                        "eval-data,adapter", "--ownership", "0", "--json", report, "--work", tmp_path / "work"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    facts = json.loads(report.read_text())
    assert facts["failures"] == [] and facts["formats"] == {"eval-data": 4, "adapter": 4}, facts
