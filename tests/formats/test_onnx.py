"""export --to onnx: one graph with optimum's names that onnxruntime runs from an empty cache, one token per call with
the cache it returned, computing transformers' logits (realistic-scale weights, odd shapes and GPT-2 124M's); the
export's own proof; onnxruntime-genai decoding from genai_config.json; refusals and failures that leave nothing; the
extra imported by this target alone."""

from __future__ import annotations

import json

import pytest
import torch

from gpt2port import export
from gpt2port.errors import GPT2PortError
from tests.realistic import realistic_checkpoint
from tests.support import assert_clean_failure, leftovers, run_cli
from tests.test_package import in_fresh_python

onnxruntime = pytest.importorskip("onnxruntime")
from gpt2port.targets import onnx as target  # noqa: E402 - after the skip: it names what the extra provides

ODD = {"3 layers, 3 heads, 48 wide": dict(n_layer=3, n_head=3, n_embd=48, n_positions=40, vocab_size=50257),
       "1 layer, 5 heads of 8": dict(n_layer=1, n_head=5, n_embd=40, n_positions=24, vocab_size=50257)}


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def greedy(path, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """onnxruntime alone: prefill from an empty cache, then a greedy token per call with the cache it returned."""
    return target.greedy(onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]), ids, mask, steps)


def check_against_transformers(hf_dir, onnx_file, prompt_len: int, steps: int, tol: float, batch: bool = True):
    """onnxruntime's greedy decoding against transformers' forward over the tokens it chose: every logit within `tol`
    (relative to the largest), and the same greedy tokens; with batch, a second, left-padded row too."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, hf.config.vocab_size, (2 if batch else 1, prompt_len), generator=g)
    mask = torch.ones_like(ids)
    if batch:  # row 1: its first 3 positions are padding (token 0, masked), its prompt the rest
        mask[1, :3] = 0
    tokens, logits = greedy(onnx_file, ids, mask, steps)
    errors = []
    for row in range(tokens.size(0)):
        start = int((mask[row] == 0).sum())
        with torch.no_grad():
            want = hf(tokens[row:row + 1, start:]).logits[0, :-1]
        got = logits[row, start:]
        errors.append(rel(got, want))
        assert errors[-1] <= tol, (row, errors[-1])
        assert torch.equal(tokens[row, prompt_len:], want[prompt_len - start - 1:].argmax(-1)), row  # greedy's
    return max(errors)


@pytest.mark.parametrize("shape", list(ODD))
def test_onnxruntime_decodes_from_an_empty_cache_as_transformers_computes(tmp_path, shape):
    hf_dir, ckpt = realistic_checkpoint(tmp_path, ODD[shape], seed=3)
    export(ckpt, tmp_path / "onnx", to="onnx")
    error = check_against_transformers(hf_dir, tmp_path / "onnx" / target.FILE_NAME, prompt_len=7, steps=9, tol=1e-4)
    assert error < 1e-4


def test_the_graph_has_optimum_s_names_and_dynamic_lengths(tmp_path, tiny_ckpt):
    import onnx

    export(tiny_ckpt, tmp_path / "o", to="onnx")
    graph = onnx.load(tmp_path / "o" / target.FILE_NAME, load_external_data=False).graph

    def dims(values):
        return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}
    L, H, D = 2, 4, 8
    kv = [f"{i}.{p}" for i in range(L) for p in ("key", "value")]
    assert dims(graph.input) == {
        "input_ids": ["batch_size", "sequence_length"],
        "attention_mask": ["batch_size", "past_sequence_length + sequence_length"],
        "position_ids": ["batch_size", "sequence_length"],
        **{f"past_key_values.{n}": ["batch_size", H, "past_sequence_length", D] for n in kv}}
    assert dims(graph.output) == {
        "logits": ["batch_size", "sequence_length", 50257],
        **{f"present.{n}": ["batch_size", H, "past_sequence_length + sequence_length", D] for n in kv}}
    # onnxruntime-genai's description names these inputs and outputs and this model's sizes
    decoder = json.loads((tmp_path / "o" / target.GENAI_CONFIG).read_text())["model"]["decoder"]
    named = {v % i if "%d" in v else v for v in (*decoder["inputs"].values(), *decoder["outputs"].values())
             for i in range(L)}
    assert named == set(dims(graph.input)) | set(dims(graph.output))
    assert (decoder["num_hidden_layers"], decoder["num_attention_heads"], decoder["head_size"]) == (L, H, D)


def test_cli_export_prints_and_records_the_proof(tmp_path, tiny_ckpt):
    r = run_cli("export", tiny_ckpt, "--to", "onnx", "--out", tmp_path / "o")
    assert r.exit_code == 0, r.output
    proof = json.loads((tmp_path / "o" / "manifest.json").read_text())["proof"]
    assert proof["max_rel_error"] < 1e-5 and proof["tolerance"] == 1e-4
    assert proof["prompt_tokens"] == 8 and proof["decoded_tokens"] == 8 and proof["greedy_agree"] == "16/16"
    assert f"max_rel_error {proof['max_rel_error']:.1e}" in r.stdout and "onnxruntime" in r.stdout
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert manifest["layout"] == "onnx" and manifest["dtype"] == "fp32"
    assert set(manifest["files"]) == {"model.onnx", "config.json", "genai_config.json", "vocab.json", "merges.txt"}
    # --force replaces an export of ours; a file of the user's in it stops it, and nothing changes
    (tmp_path / "o" / "notes.txt").write_text("mine")
    assert_clean_failure(run_cli("export", tiny_ckpt, "--to", "onnx", "--out", tmp_path / "o", "--force"),
                         names=["notes.txt"])
    (tmp_path / "o" / "notes.txt").unlink()
    assert run_cli("export", tiny_ckpt, "--to", "onnx", "--out", tmp_path / "o", "--force").exit_code == 0


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_onnxruntime_genai_decodes_gpt2port_s_greedy_tokens(tmp_path, dtype):
    """onnxruntime-genai, given the export directory alone (genai_config.json), greedy-decodes what gpt2port's
    generate does (fp32) or what onnxruntime does with the same graph, a call per token (fp16, whose near ties may
    part from fp32's)."""
    og = pytest.importorskip("onnxruntime_genai")
    import numpy as np

    from gpt2port import GPT
    from gpt2port.generate import generate

    _, ckpt = realistic_checkpoint(tmp_path, ODD["3 layers, 3 heads, 48 wide"], seed=3)
    export(ckpt, tmp_path / "onnx", to="onnx", dtype=dtype)
    prompt = [464, 3290, 318, 257, 1332, 11, 290]
    model = og.Model(str(tmp_path / "onnx"))
    generator = og.Generator(model, og.GeneratorParams(model))
    generator.append_tokens(np.array(prompt, dtype=np.int32))
    while not generator.is_done():  # to genai_config.json's max_length, the model's 40 positions, or <|endoftext|>
        generator.generate_next_token()
    got = [int(t) for t in generator.get_sequence(0)][len(prompt):]
    if dtype == "fp32":
        want = generate(GPT.from_pretrained(ckpt), [prompt], 40 - len(prompt), temperature=0, stop_token=None)[0]
    else:
        ids = torch.tensor([prompt])
        want = greedy(tmp_path / "onnx" / target.FILE_NAME, ids, torch.ones_like(ids), 40 - len(prompt))[0]
        want = want[0, len(prompt):].tolist()
    assert len(set(want)) > 3  # a sequence, not one token repeated
    assert got == want[:len(got)] and (len(got) == len(want) or got[-1] == 50256), (got, want)


def test_fp16_runs_in_onnxruntime_near_transformers_fp32(tmp_path):
    hf_dir, ckpt = realistic_checkpoint(tmp_path, ODD["3 layers, 3 heads, 48 wide"], seed=4)
    result = export(ckpt, tmp_path / "onnx", to="onnx", dtype="fp16")
    assert result.proof["max_rel_error"] <= target.TOLERANCE[torch.float16]
    session = onnxruntime.InferenceSession(str(tmp_path / "onnx" / target.FILE_NAME))
    assert {i.type for i in session.get_inputs() if i.name.startswith("past")} == {"tensor(float16)"}
    # against transformers in fp32 over the unrounded weights: the rounding and fp16 arithmetic together
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50257, (1, 7), generator=g)
    tokens, logits = greedy(tmp_path / "onnx" / target.FILE_NAME, ids, torch.ones_like(ids), 6)
    from transformers import GPT2LMHeadModel

    with torch.no_grad():
        want = GPT2LMHeadModel.from_pretrained(hf_dir).eval()(tokens).logits[0, :-1]
    assert rel(logits[0], want) < 2e-2


def test_weights_past_the_limit_go_beside_the_graph(tmp_path, tiny_ckpt, monkeypatch):
    """Past protobuf's 2 GB (gpt2-large and up) the weights are model.onnx.data; the limit lowered to 0 here."""
    monkeypatch.setattr(target, "INLINE_LIMIT", 0)
    result = export(tiny_ckpt, tmp_path / "o", to="onnx")
    records = json.loads((tmp_path / "o" / "manifest.json").read_text())["files"]
    files = {name: rec["size"] for name, rec in records.items()}
    assert files[target.DATA_NAME] > 6_000_000 > files[target.FILE_NAME]
    assert result.bytes_written == files[target.DATA_NAME] + files[target.FILE_NAME]
    assert result.proof["max_rel_error"] < 1e-5  # onnxruntime read the weights from beside the graph


def test_a_failed_proof_leaves_nothing(tmp_path, tiny_ckpt, monkeypatch):
    monkeypatch.setitem(target.TOLERANCE, torch.float32, 0.0)
    with pytest.raises(GPT2PortError, match="onnxruntime's logits differ from gpt2port's"):
        export(tiny_ckpt, tmp_path / "o", to="onnx")
    assert not (tmp_path / "o").exists() and leftovers(tmp_path) == []


def test_refusals_name_the_problem_and_leave_nothing(tmp_path, tiny_ckpt, monkeypatch):
    line = assert_clean_failure(run_cli("export", tiny_ckpt, "--to", "onnx", "--dtype", "bf16", "--out",
                                        tmp_path / "o"), names=["fp32 or fp16", "bf16"])
    assert "--dtype" in line
    monkeypatch.setitem(__import__("sys").modules, "onnxruntime", None)  # the extra not installed
    line = assert_clean_failure(run_cli("export", tiny_ckpt, "--to", "onnx", "--out", tmp_path / "o"))
    assert "pip install 'gpt2port[onnx]'" in line
    assert not (tmp_path / "o").exists() and leftovers(tmp_path) == []


def test_other_commands_never_import_the_onnx_extra(tiny_ckpt, tmp_path):
    in_fresh_python("import sys, gpt2port\n"
                    f"gpt2port.export({str(tiny_ckpt)!r}, {str(tmp_path / 'g')!r}, to='gguf')\n"
                    "gpt2port.GPT.from_pretrained(" + repr(str(tiny_ckpt)) + ")\n"
                    "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('onnx', 'onnxruntime', "
                    "'onnxscript'))\n"
                    "assert not loaded, loaded\n")


@pytest.mark.heavy
@pytest.mark.parametrize("dtype, tol", [("fp32", 1e-4), ("fp16", 2e-2)])
def test_gpt2_124m_shape_in_onnxruntime_as_transformers(tmp_path, dtype, tol):
    """GPT-2 124M's shape, realistic-scale weights: fp32 to 1e-4 of transformers' logits and the same greedy tokens
    (fp16: within its own bound, the tokens may part at near ties, so only the logits are checked)."""
    hf_dir, ckpt = realistic_checkpoint(tmp_path, "gpt2", seed=7)
    export(ckpt, tmp_path / "onnx", to="onnx", dtype=dtype)
    onnx_file = tmp_path / "onnx" / target.FILE_NAME
    if dtype == "fp32":
        assert check_against_transformers(hf_dir, onnx_file, prompt_len=12, steps=8, tol=tol) < tol
    else:
        ids = torch.randint(0, 50257, (1, 12), generator=torch.Generator().manual_seed(1))
        tokens, logits = greedy(onnx_file, ids, torch.ones_like(ids), 8)
        from transformers import GPT2LMHeadModel

        with torch.no_grad():
            want = GPT2LMHeadModel.from_pretrained(hf_dir).eval()(tokens).logits[0, :-1]
        assert rel(logits[0], want) < tol


def test_an_edit_to_model_py_is_in_the_next_export(tmp_path, tiny_ckpt, monkeypatch):
    """The graph is the model's own forward: an MLP edited in model.py is what onnxruntime computes (and the proof,
    which compares with that forward, still passes)."""
    from gpt2port import GPT, model

    monkeypatch.setattr(model.MLP, "forward", lambda self, x: 0.5 * self.proj(torch.tanh(self.fc(x))))
    result = export(tiny_ckpt, tmp_path / "o", to="onnx")
    assert result.proof["max_rel_error"] < 1e-5
    ids = torch.tensor([[464, 3290, 318, 257]])
    _, logits = greedy(tmp_path / "o" / target.FILE_NAME, ids, torch.ones_like(ids), 1)
    with torch.no_grad():
        torch.testing.assert_close(logits, GPT.from_pretrained(tiny_ckpt)(ids)[0], rtol=1e-5, atol=1e-5)
        monkeypatch.undo()
        assert rel(logits, GPT.from_pretrained(tiny_ckpt)(ids)[0]) > 1e-2


@pytest.mark.heavy
def test_gpt2_xl_shape_with_its_weights_beside_the_graph(tmp_path):
    """gpt2-xl's shape (1.5B; 6.2 GB of fp32 weights, past protobuf's 2 GB): model.onnx.data beside a small graph,
    both recorded, and the export's proof (onnxruntime, fed gpt2port's greedy tokens one per call, against gpt2port's
    forward) passes. Random weights written tensor by tensor (an HF model built to save them would hold 6 GB more);
    about 20 GB of disk and 7 GB of memory at peak (scripts/bench/onnx_export.py measures it)."""
    from gpt2port import convert
    from scripts import hf_fixtures

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    hf_fixtures.write_random_hub_file(hf_dir / "model.safetensors", "gpt2-xl", "fp32", seed=0)
    convert(hf_dir, tmp_path / "ckpt")
    (hf_dir / "model.safetensors").unlink()
    result = export(tmp_path / "ckpt", tmp_path / "onnx", to="onnx")
    files = {name: rec["size"] for name, rec in
             json.loads((tmp_path / "onnx" / "manifest.json").read_text())["files"].items()}
    assert files[target.DATA_NAME] > 6_000_000_000 and files[target.FILE_NAME] < 10_000_000
    assert result.proof["max_rel_error"] <= 1e-4 and result.proof["greedy_agree"] == "16/16"
    genai = json.loads((tmp_path / "onnx" / target.GENAI_CONFIG).read_text())["model"]["decoder"]
    assert (genai["num_hidden_layers"], genai["num_attention_heads"], genai["hidden_size"]) == (48, 25, 1600)
