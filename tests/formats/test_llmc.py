"""llm.c export and import: the files parsed independently of gpt2port (numpy and struct, from the format's
description), the debug state against a direct forward and backward, bit-exact round trips, one-line refusals that
leave nothing behind, and (given an llm.c checkout in GPT2PORT_LLMC_DIR) llm.c's own test_gpt2 on an export."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from gpt2port import GPT, export
from gpt2port.targets.llmc import batch
from gpt2port.tokenizer import from_directory
from tests.support import assert_clean_failure, leftovers, run_cli, snapshot

# The format as llm.c's train_gpt2.py writes it, restated here rather than imported: the test is a second reading.
KINDS = [("ln1w", "ln1.weight"), ("ln1b", "ln1.bias"), ("qkvw", "attn.qkv.weight"), ("qkvb", "attn.qkv.bias"),
         ("attprojw", "attn.proj.weight"), ("attprojb", "attn.proj.bias"), ("ln2w", "ln2.weight"),
         ("ln2b", "ln2.bias"), ("fcw", "mlp.fc.weight"), ("fcb", "mlp.fc.bias"), ("fcprojw", "mlp.proj.weight"),
         ("fcprojb", "mlp.proj.bias")]


def expected_order(state: dict, n_layer: int) -> list[tuple[str, str]]:
    """(llm.c kind, gpt2port name) in file order: wte, wpe, each per-layer kind for all layers, lnfw, lnfb."""
    out = [("wte", "tok_emb.weight"), ("wpe", "pos_emb.weight")]
    for kind, name in KINDS:
        out += [(kind, f"blocks.{i}.{name}") for i in range(n_layer)]
    return out + [("lnfw", "final_norm.weight"), ("lnfb", "final_norm.bias")]


def split(data: np.ndarray, state: dict, n_layer: int, vp: int) -> dict[str, np.ndarray]:
    """A flat array of every parameter in file order -> gpt2port name -> array (wte keeps its padding rows)."""
    out, at = {}, 0
    for _, name in expected_order(state, n_layer):
        shape = list(state[name].shape)
        if name == "tok_emb.weight":
            shape[0] = vp
        n = int(np.prod(shape))
        out[name] = data[at:at + n].reshape(shape)
        at += n
    assert at == data.size
    return out


def ints(path: Path, n: int = 256) -> list[int]:
    return list(struct.unpack(f"<{n}i", path.read_bytes()[:4 * n]))


@pytest.fixture(scope="module")
def llmc_dir(tmp_path_factory, tiny_ckpt):
    out = tmp_path_factory.mktemp("llmc") / "tiny"
    export(tiny_ckpt, out, to="llmc", options={"debug_state": True})
    return out


@pytest.fixture(scope="module")
def tiny_state(tiny_ckpt):
    return load_file(tiny_ckpt / "model.safetensors")


def test_model_file_header_order_and_padding(llmc_dir, tiny_ckpt, tiny_state):
    config = json.loads((tiny_ckpt / "config.json").read_text())["model"]
    assert sorted(p.name for p in llmc_dir.iterdir()) == ["gpt2_model.bin", "gpt2_model_debug_state.bin",
                                                          "gpt2_tokenizer.bin", "manifest.json"]
    path = llmc_dir / "gpt2_model.bin"
    h = ints(path)
    V, L = config["vocab_size"], config["n_layer"]
    assert h[:8] == [20240326, 3, config["n_positions"], V, L, config["n_head"], config["n_embd"], 50304]
    assert h[8:] == [0] * 248
    tensors = split(np.fromfile(path, dtype="<f4", offset=1024), tiny_state, L, 50304)
    for name, t in tensors.items():
        want = tiny_state[name].numpy()
        if name == "tok_emb.weight":
            assert not t[V:].any(), "the padding rows are zeros"
            t = t[:V]
        assert np.array_equal(t, want), name


def test_bf16_model_file(tmp_path, tiny_ckpt, tiny_state):
    out = tmp_path / "bf16"
    export(tiny_ckpt, out, to="llmc", dtype="bf16")
    path = out / "gpt2_model.bin"
    assert ints(path)[:2] == [20240326, 5]
    raw = np.fromfile(path, dtype="<u2", offset=1024)
    tensors = split(raw, tiny_state, 2, 50304)
    for name, t in tensors.items():
        want = tiny_state[name].to(torch.bfloat16).view(torch.int16).numpy().view("<u2")
        assert np.array_equal(t[:want.shape[0]], want), name


def test_tokenizer_file(llmc_dir, tiny_ckpt):
    data = (llmc_dir / "gpt2_tokenizer.bin").read_bytes()
    h = list(struct.unpack("<256i", data[:1024]))
    assert h[:4] == [20240328, 2, 50257, 50256] and h[4:] == [0] * 252
    enc = from_directory(tiny_ckpt)
    at, tokens = 1024, []
    while at < len(data):
        tokens.append(data[at + 1:at + 1 + data[at]])
        at += 1 + data[at]
    assert at == len(data)
    assert tokens == [enc.decode_single_token_bytes(i) for i in range(50257)]


def test_debug_state_is_gpt2ports_forward_and_backward(llmc_dir, tiny_ckpt, tiny_state):
    path = llmc_dir / "gpt2_model_debug_state.bin"
    h = ints(path)
    assert h[:4] == [20240327, 2, 4, 64] and h[4:] == [0] * 252
    B, T, V = 4, 64, 50257
    raw = path.read_bytes()[1024:]
    x = np.frombuffer(raw, "<i4", B * T).reshape(B, T)
    y = np.frombuffer(raw, "<i4", B * T, offset=4 * B * T).reshape(B, T)
    floats = np.frombuffer(raw, "<f4", offset=8 * B * T)
    logits, loss, grads = floats[:B * T * V].reshape(B, T, V), floats[B * T * V], floats[B * T * V + 1:]
    # The batch is the shipped text, tokenized by the checkpoint's tokenizer, targets shifted by one.
    want_x, want_y = batch(from_directory(tiny_ckpt))
    assert np.array_equal(x, want_x.numpy()) and np.array_equal(y, want_y.numpy())
    assert np.array_equal(x[0, 1:], y[0, :-1])
    model = GPT.from_pretrained(tiny_ckpt, dtype=torch.float32)
    model.requires_grad_(True)
    direct_logits, direct_loss = model(want_x, want_y)
    direct_loss.backward()
    assert torch.equal(torch.from_numpy(logits.copy()), direct_logits.detach())
    assert loss == direct_loss.item()
    tensors = split(grads, tiny_state, 2, 50304)
    params = dict(model.named_parameters())
    for name, g in tensors.items():
        if name == "tok_emb.weight":
            assert not g[V:].any()
            g = g[:V]
        assert np.array_equal(g, params[name].grad.numpy()), name
    # The tied head's share is in dwte: the tokens never seen as inputs still have gradients.
    unseen = sorted(set(range(V)) - set(x.flatten().tolist()))[:5]
    assert np.abs(tensors["tok_emb.weight"][unseen]).sum() > 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_round_trip_is_bit_exact(tmp_path, tiny_ckpt, dtype):
    start = tiny_ckpt
    if dtype == "bf16":
        start = tmp_path / "bf16"
        export(tiny_ckpt, start, dtype="bf16")
    exported = tmp_path / "llmc"
    export(start, exported, to="llmc")
    back = tmp_path / "back"
    result = run_cli("convert", exported / "gpt2_model.bin", "--out", back)
    assert result.exit_code == 0, result.output
    a, b = load_file(start / "model.safetensors"), load_file(back / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    assert json.loads((back / "config.json").read_text()) == json.loads((start / "config.json").read_text())
    # The tokenizer came back from gpt2_tokenizer.bin alone: GPT-2's vocabulary, merges in their order.
    assert json.loads((back / "vocab.json").read_bytes()) == json.loads((start / "vocab.json").read_bytes())
    def merges(p):
        return [line for line in p.read_text(encoding="utf-8").splitlines() if line and not line.startswith("#")]

    assert merges(back / "merges.txt") == merges(start / "merges.txt")
    assert json.loads((back / "manifest.json").read_text())["warnings"] == []


def test_without_tokenizer_the_manifest_says_so(tmp_path, llmc_dir):
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(llmc_dir / "gpt2_model.bin", alone)
    result = run_cli("convert", alone / "gpt2_model.bin", "--out", tmp_path / "back")
    assert result.exit_code == 0, result.output
    warnings = json.loads((tmp_path / "back" / "manifest.json").read_text())["warnings"]
    assert len(warnings) == 1 and "converted without tokenizer files" in warnings[0]
    assert not (tmp_path / "back" / "vocab.json").exists()


def _edit_header(data: bytes, index: int, value: int) -> bytes:
    return data[:4 * index] + struct.pack("<i", value) + data[4 * index + 4:]


@pytest.mark.parametrize("damage, message", [
    (lambda d: _edit_header(d, 0, 1234), "neither a PyTorch pickle nor an llm.c model file"),
    (lambda d: _edit_header(d, 1, 4), "version 4 is not supported"),
    (lambda d: d[:-4], "truncated"),
    (lambda d: d[:600], "truncated"),
    (lambda d: d + b"\0" * 8, "unexplained bytes"),
    (lambda d: _edit_header(d, 4, 3), "truncated"),  # a header claiming another layer count
    (lambda d: _edit_header(d, 5, 5), "do not make a GPT-2"),  # 32 channels in 5 heads
    (lambda d: _edit_header(d, 7, 50257), "padded_vocab_size"),
    (lambda d: _edit_header(d, 4, 10**9), "truncated"),  # a hostile size fails on the length, allocating nothing
], ids=["magic", "version", "truncated", "header-only", "trailing", "layers", "heads", "padding", "huge"])
def test_bad_model_files_are_refused(tmp_path, llmc_dir, damage, message):
    bad = tmp_path / "src" / "gpt2_model.bin"
    bad.parent.mkdir()
    bad.write_bytes(damage((llmc_dir / "gpt2_model.bin").read_bytes()))
    before = snapshot(tmp_path / "src")
    result = run_cli("convert", bad, "--out", tmp_path / "out")
    line = assert_clean_failure(result, names=[bad])
    assert message in line
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
    assert snapshot(tmp_path / "src") == before


def test_other_llmc_files_are_not_models(tmp_path, llmc_dir):
    for name in ("gpt2_tokenizer.bin", "gpt2_model_debug_state.bin"):
        result = run_cli("convert", llmc_dir / name, "--out", tmp_path / "out")
        assert "not a model file" in assert_clean_failure(result, names=[llmc_dir / name])
        assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_export_refusals_leave_nothing(tmp_path, tiny_ckpt):
    result = run_cli("export", tiny_ckpt, "--to", "llmc", "--dtype", "fp16", "--out", tmp_path / "out")
    assert "fp32 or bf16" in assert_clean_failure(result)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


@pytest.mark.skipif(not os.environ.get("GPT2PORT_LLMC_DIR"), reason="set GPT2PORT_LLMC_DIR to an llm.c checkout")
def test_llmc_test_gpt2_accepts_the_export(tmp_path, tiny_ckpt):
    from scripts import check_llmc

    result = check_llmc.check(Path(os.environ["GPT2PORT_LLMC_DIR"]), tiny_ckpt, tmp_path)
    assert result.ok, result.output
