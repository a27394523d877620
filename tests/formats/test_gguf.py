"""GGUF export and import: what llama.cpp's loader reads (names, shapes, types, metadata, tokenizer), round trips,
and refusals that leave nothing behind. Read back with llama.cpp's own gguf package, not with our reader."""

from __future__ import annotations

import ast
import shutil

import gguf
import pytest
import torch
from safetensors.torch import load_file

from gpt2port import convert, export
from gpt2port.checkpoint import read_config
from gpt2port.errors import GPT2PortError
from gpt2port.targets.gguf import FILE_NAME
from scripts import hf_fixtures
from tests.support import ROOT, assert_clean_failure, leftovers, run_cli

Q = gguf.GGMLQuantizationType
PER_BLOCK = ["attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"]


@pytest.fixture(scope="module")
def exported(tiny_ckpt, tmp_path_factory):
    """export(tiny, to="gguf", dtype=d) per dtype, made once."""
    made = {}

    def make(dtype: str = "fp32"):
        if dtype not in made:
            out = tmp_path_factory.mktemp(f"gguf-{dtype}")
            export(tiny_ckpt, out / "g", to="gguf", dtype=dtype)
            made[dtype] = out / "g" / FILE_NAME
        return made[dtype]

    return make


def _fields(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


@pytest.mark.parametrize("dtype, matrix_type", [("fp32", Q.F32), ("fp16", Q.F16), ("bf16", Q.BF16), ("q8_0", Q.Q8_0)])
def test_names_shapes_types_as_llama_cpp_loads_them(exported, tiny_ckpt, dtype, matrix_type):
    config = read_config(tiny_ckpt)
    C, F, V, P = config.n_embd, config.mlp_width, config.vocab_size, config.n_positions
    reader = gguf.GGUFReader(exported(dtype))
    got = {t.name: (tuple(int(d) for d in t.shape), t.tensor_type) for t in reader.tensors}
    # GGUF dims innermost first: llama.cpp's loader asks for exactly these (token_embd {n_embd, n_vocab}, ...).
    want = {"token_embd.weight": ((C, V), matrix_type), "position_embd.weight": ((C, P), Q.F32),
            "output_norm.weight": ((C,), Q.F32), "output_norm.bias": ((C,), Q.F32)}
    for i in range(config.n_layer):
        want.update({
            f"blk.{i}.attn_norm.weight": ((C,), Q.F32), f"blk.{i}.attn_norm.bias": ((C,), Q.F32),
            f"blk.{i}.attn_qkv.weight": ((C, 3 * C), matrix_type), f"blk.{i}.attn_qkv.bias": ((3 * C,), Q.F32),
            f"blk.{i}.attn_output.weight": ((C, C), matrix_type), f"blk.{i}.attn_output.bias": ((C,), Q.F32),
            f"blk.{i}.ffn_norm.weight": ((C,), Q.F32), f"blk.{i}.ffn_norm.bias": ((C,), Q.F32),
            f"blk.{i}.ffn_up.weight": ((C, F), matrix_type), f"blk.{i}.ffn_up.bias": ((F,), Q.F32),
            f"blk.{i}.ffn_down.weight": ((F, C), matrix_type), f"blk.{i}.ffn_down.bias": ((C,), Q.F32),
        })
    assert got == want  # the tied head is not written: llama.cpp falls back to token_embd
    fields = _fields(reader)
    assert fields["general.architecture"] == "gpt2"
    assert {k: fields[k] for k in ("gpt2.block_count", "gpt2.context_length", "gpt2.embedding_length",
                                   "gpt2.feed_forward_length", "gpt2.attention.head_count")} == {
        "gpt2.block_count": config.n_layer, "gpt2.context_length": P, "gpt2.embedding_length": C,
        "gpt2.feed_forward_length": F, "gpt2.attention.head_count": config.n_head}
    assert fields["gpt2.attention.layer_norm_epsilon"] == pytest.approx(config.layer_norm_epsilon)
    file_types = {"fp32": 0, "fp16": 1, "bf16": 32, "q8_0": 7}
    assert fields["general.file_type"] == file_types[dtype]


def test_tokenizer_is_embedded(exported, tiny_ckpt):
    fields = _fields(gguf.GGUFReader(exported("fp32")))
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    tokens, types, merges = (fields[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "merges"))
    assert len(tokens) == len(types) == 50257 and len(merges) == 50000
    assert tokens[50256] == "<|endoftext|>" and types[50256] == gguf.TokenType.CONTROL
    assert tokens[220] == "\u0120" and types[220] == gguf.TokenType.NORMAL  # byte-level strings: the space byte
    assert merges[0] == "\u0120 t"
    assert fields["tokenizer.ggml.bos_token_id"] == fields["tokenizer.ggml.eos_token_id"] == 50256


def test_output_tensor_on_request(tiny_ckpt, tmp_path):
    export(tiny_ckpt, tmp_path / "g", to="gguf", options={"output_tensor": True})
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "g" / FILE_NAME).tensors}
    assert (tensors["output.weight"].data == tensors["token_embd.weight"].data).all()
    convert(tmp_path / "g" / FILE_NAME, tmp_path / "back")  # a copy equal to the embedding is accepted on read


def test_round_trip_is_bit_exact(exported, tiny_ckpt, tmp_path):
    convert(exported("fp32"), tmp_path / "back")
    a, b = load_file(tiny_ckpt / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert read_config(tmp_path / "back") == read_config(tiny_ckpt)
    from gpt2port.tokenizer import from_directory

    text = "Hello world, it's GGUF! \u00e9\u4e2d <|endoftext|>"
    assert (from_directory(tmp_path / "back").encode(text, allowed_special="all")
            == from_directory(tiny_ckpt).encode(text, allowed_special="all"))


def test_half_round_trip_is_bit_exact(tiny_ckpt, tmp_path):
    export(tiny_ckpt, tmp_path / "h", dtype="bf16")
    export(tmp_path / "h", tmp_path / "g", to="gguf")  # default: the checkpoint's own dtype
    convert(tmp_path / "g" / FILE_NAME, tmp_path / "back")
    a, b = load_file(tmp_path / "h" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert all(b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype", ["q8_0", "q4_k_m", "q6_k"])
def test_a_type_no_tensor_row_fits_is_refused(dtype, tmp_path):
    """Rows of 48: no 32-value type takes them, and the K-quants' fallbacks (Q5_0, Q5_1, Q8_0) neither, where
    llama.cpp would write F16. One line naming the type and the tensor, nothing left behind."""
    repo = tmp_path / "hf"
    hf_fixtures.write_repo(hf_fixtures.make_hf_model(hf_fixtures.hf_config({**hf_fixtures.TINY, "n_embd": 48})),
                           repo, "hub", "fp32")
    convert(repo, tmp_path / "ck")
    with pytest.raises(GPT2PortError, match=r"(q8_0|q5_0) needs rows whose length divides by 32; \S+ has rows of 48"
                       ) as e:
        export(tmp_path / "ck", tmp_path / "out" / "g", to="gguf", dtype=dtype)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)
    result = run_cli("export", tmp_path / "ck", "--to", "gguf", "--dtype", dtype, "--out", tmp_path / "out")
    assert_clean_failure(result, names=["divides by 32", "rows of 48"])
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_import_refusals_name_the_file_and_leave_nothing(exported, tmp_path):
    good = exported("fp32").read_bytes()
    cases = {
        "truncated.gguf": good[: len(good) // 2],
        "header-only.gguf": good[:100_000],
        "not-gguf.gguf": b"GGUF\x03\x00\x00\x00",
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    other = tmp_path / "llama.gguf"
    writer = gguf.GGUFWriter(other, "llama")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reasons = {"truncated.gguf": "truncated", "header-only.gguf": "truncated", "not-gguf.gguf": "not a readable GGUF",
               "llama.gguf": "architecture 'llama'"}  # quantized types: test_gguf_q8_0.py
    for name, reason in reasons.items():
        result = run_cli("convert", str(tmp_path / name), "--out", str(tmp_path / "out" / name))
        assert result.exit_code == 1 and result.exception is None or isinstance(result.exception, SystemExit)
        line = result.output.strip()
        assert "\n" not in line and name in line and reason in line, line
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_cli_export_gguf(tiny_ckpt, tmp_path):
    result = run_cli("export", str(tiny_ckpt), "--to", "gguf", "--dtype", "q8_0", "--gguf-output-tensor",
                     "--out", str(tmp_path / "g"))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "g").iterdir()) == ["manifest.json", FILE_NAME]
    bad = run_cli("export", str(tiny_ckpt), "--to", "hf", "--dtype", "q8_0", "--out", str(tmp_path / "h"))
    assert bad.exit_code == 1 and not (tmp_path / "h").exists()


def test_export_without_tokenizer_is_refused(tiny_ckpt, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    (ck / "vocab.json").unlink()
    (ck / "merges.txt").unlink()
    with pytest.raises(GPT2PortError, match="no tokenizer files"):
        export(ck, tmp_path / "g", to="gguf")
    assert not (tmp_path / "g").exists() and not leftovers(tmp_path)


def test_the_writer_never_replaces_a_file(tmp_path):
    """The gguf package opens its output with "wb": write_gguf must refuse a path that exists, not truncate it."""
    from gpt2port.formats.gguf import write_gguf

    path = tmp_path / "model.gguf"
    path.write_bytes(b"a user's file")
    plan = [("x.weight", (2, 32), Q.F32, lambda: torch.ones(2, 32))]
    with pytest.raises(GPT2PortError, match="cannot create"):
        write_gguf(path, "gpt2", plan, lambda writer: None)
    assert path.read_bytes() == b"a user's file" and sorted(tmp_path.iterdir()) == [path]

def _uses_gguf(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Import) and any(a.name.split(".")[0] == "gguf" for a in n.names)
               or isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "gguf" for n in ast.walk(tree))


def _own(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def test_only_the_gguf_packages_public_api_is_used():
    """What a gguf release may change without notice stays out of reach: no subclass of its classes, no attribute
    set on an object we did not make, no private attribute read (so that pyproject.toml need not cap its version)."""
    found = []
    for path in sorted((ROOT / "gpt2port").rglob("*.py")):
        tree = ast.parse(path.read_text())
        if not _uses_gguf(tree):
            continue
        where = lambda n: f"{path.relative_to(ROOT)}:{n.lineno}"  # noqa: E731
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found += [f"{where(node)} subclasses {ast.unparse(b)}" for b in node.bases
                          if ast.unparse(b).startswith("gguf.")]
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                        if isinstance(e, ast.Attribute) and not _own(e.value):
                            found.append(f"{where(node)} sets {ast.unparse(e)}")
            elif (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                  and not _own(node.value)):
                found.append(f"{where(node)} reads {ast.unparse(node)}")
    assert not found, found
