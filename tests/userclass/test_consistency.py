"""Issue 39, findings 5-7: a book-style class (tests/userclass/book.py) saves at its own precision; save_from and
load_into give the same diagnosis; eps named as measured; meta-built and float64 classes get one answer along the
whole path; check's reference and factory errors. Issue 40: one activation table; what load_into did is a record
on the model, not a module-global registry. All on weights at trained-like scales (tests/realistic.py)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import gpt2port
from gpt2port import GPT2PortError
from gpt2port.checkpoint import load_state
from scripts import hf_fixtures
from tests.userclass import book
from tests.userclass.test_save_from import as_if_trained, ids, in_transformers, rel

TINY = hf_fixtures.TINY
REL = 1e-5


def build(sizes=TINY, **more):
    return book.GPTModel(book.config(sizes, **more)).eval()


# --- finding 5: tolerance by the class's own precision ---------------------------------------------------------------

@pytest.mark.parametrize("width", [32, 64])
def test_the_book_class_trained_from_scratch_saves_and_is_itself_in_transformers(width, tmp_path):
    """Its GELU's sqrt(2/pi) is a float32 tensor even inside facts.py's float64 probe: that is the class's own
    rounding (1.1e-9 relative at width 64), not another function."""
    model = as_if_trained(build(dict(TINY, n_embd=width)))
    out = gpt2port.save_from(model, tmp_path / "book")
    cfg = json.loads((out / "config.json").read_text())["model"]
    assert cfg["n_head"] == TINY["n_head"] and cfg["activation"] == "gelu_new"
    assert out.report.max_rel < REL
    hf, _ = in_transformers(out, tmp_path)
    with torch.no_grad():
        assert rel(hf(ids()).logits, model(ids())) < REL


@pytest.mark.heavy
def test_the_book_class_at_124m_trained_from_scratch_saves_as_itself(tmp_path):
    model = as_if_trained(build(dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257)))
    out = gpt2port.save_from(model, tmp_path / "book124")
    assert out.report.max_rel < 1e-4
    hf, _ = in_transformers(out, tmp_path)
    with torch.no_grad():
        assert rel(hf(ids(T=16)).logits, model(ids(T=16))) < 1e-4


def test_the_book_class_loaded_and_saved_is_itself_in_transformers(tmp_path, real_ckpt):
    model = build()
    gpt2port.load_into(model, real_ckpt)
    out = gpt2port.save_from(model, tmp_path / "book")
    hf, _ = in_transformers(out, tmp_path)
    with torch.no_grad():
        assert rel(hf(ids()).logits, model(ids())) < REL


# --- finding 6: one answer along the path ----------------------------------------------------------------------------

@pytest.mark.parametrize("mistake", ["unscaled", "mask2", "post_ln"])
def test_save_from_names_what_load_into_names(mistake, real_ckpt, tmp_path):
    """A GELU class whose fault is in attention or the norms' place: save_from's refusal is load_into's diagnosis,
    never a "closest" activation."""
    loaded = build(options=(mistake,))
    with pytest.raises(GPT2PortError) as at_load:
        gpt2port.load_into(loaded, real_ckpt)
    said = at_load.value.reasons[0].split(" on a ")[0]
    trained = as_if_trained(build(options=(mistake,)))
    with pytest.raises(GPT2PortError) as at_save:
        gpt2port.save_from(trained, tmp_path / "out")
    text = str(at_save.value)
    assert "ReLU" not in text and "SiLU" not in text, text
    assert said.split(":")[0] in text, (said, text)  # the stage: "block 0"
    mistake = said.split("explained by: ")[1].split(" (rel")[0] if "explained by: " in said else \
        "no known mistake explains it"
    assert mistake in text, (said, text)
    assert not (tmp_path / "out").exists()


def test_an_eps_is_named_as_measured(real_ckpt, tmp_path):
    """LayerNorm eps 1e-12 (BERT's) is named 1e-12, at load and at save, not another value fp32 cannot tell from it."""
    model = build(eps=1e-12)
    with pytest.raises(GPT2PortError) as e:
        gpt2port.load_into(model, real_ckpt)
    assert "eps 1e-12" in str(e.value) and "eps 1e-08" not in str(e.value), str(e.value)
    out = gpt2port.save_from(as_if_trained(build(eps=1e-12)), tmp_path / "eps")
    assert json.loads((out / "config.json").read_text())["model"]["layer_norm_epsilon"] == 1e-12


def test_a_meta_built_class_is_told_to_use_init_empty(real_ckpt):
    """A class built under torch.device("meta") whose mask buffer is an additive -inf mask: its values are gone, and
    what cannot be rebuilt is said with the remedy, init_empty()."""
    class Additive(book.MultiHeadAttention):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            n = self.mask.shape[0]
            self.register_buffer("mask", torch.full((n, n), float("-inf")).triu(1))

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = (m(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
                       for m in (self.W_query, self.W_key, self.W_value))
            w = torch.softmax(q @ k.transpose(2, 3) / self.head_dim ** 0.5 + self.mask[:n, :n], dim=-1)
            return self.out_proj((w @ v).transpose(1, 2).reshape(b, n, self.d_out))

    def make():
        model = build()
        for blk in model.trf_blocks:
            old = blk.att
            blk.att = Additive(TINY["n_embd"], TINY["n_embd"], TINY["n_positions"], 0.0, TINY["n_head"], True)
            del old
        return model

    with torch.device("meta"):
        meta = make()
    with pytest.raises(GPT2PortError) as e:
        gpt2port.load_into(meta, real_ckpt)
    assert "init_empty()" in str(e.value), str(e.value)
    with gpt2port.init_empty():
        empty = make()
    assert "logits equal" in gpt2port.load_into(empty, real_ckpt).proven


def test_a_float64_class_is_verified_and_saved_as_fp32_said_once(real_ckpt, real_hf, tmp_path):
    model = build().double()
    report = gpt2port.load_into(model, real_ckpt)
    assert "logits equal" in report.proven
    assert gpt2port.verify_model(model, real_hf, hf=False, tokens=16).passed
    out = gpt2port.save_from(model, tmp_path / "f64")
    _, _, state = load_state(out)
    assert {t.dtype for t in state.values()} == {torch.float32}
    said = [n for n in out.report.notes if "float64" in n]
    assert len(said) == 1 and "fp32" in said[0], out.report.notes
    with torch.no_grad():
        assert rel(gpt2port.GPT.from_pretrained(out)(ids())[0], model(ids()).float()) < REL


# --- issue 40: what load_into did is a visible record; one activation table -----------------------------------------

def test_what_load_into_did_is_a_record_on_the_model(real_ckpt, tmp_path):
    """The record travels with the model (a copy is saved as the original is) and can be handed over explicitly;
    no module-global registry makes two identical calls behave differently."""
    model = build()
    report = gpt2port.load_into(model, real_ckpt)
    assert model.gpt2port_load is report
    twin = copy.deepcopy(model)
    a = gpt2port.save_from(model, tmp_path / "a")
    b = gpt2port.save_from(twin, tmp_path / "b")
    assert json.loads((a / "manifest.json").read_text())["source"] == \
        json.loads((b / "manifest.json").read_text())["source"]
    fresh = copy.deepcopy(model)
    del fresh.gpt2port_load
    c = gpt2port.save_from(fresh, tmp_path / "c", report=report)
    assert json.loads((c / "manifest.json").read_text())["source"] == \
        json.loads((a / "manifest.json").read_text())["source"]


def test_the_mlp_activation_is_one_table(tmp_path, real_ckpt):
    """config, conversion, load_into, save_from and the float64 reference read one table."""
    from gpt2port import activations, config
    from gpt2port.targets import REGISTRY
    from gpt2port.verification import reference

    table = activations.TABLE
    assert set(config.ACTIVATIONS) == set(table)
    assert set(reference.ACTIVATIONS) == set(table)
    for name, act in table.items():
        for target in REGISTRY:
            assert activations.expressible(name, REGISTRY[target]) == (act.tanh_gelu or not REGISTRY[target].tanh_gelu)
    x = torch.linspace(-4, 4, 101, dtype=torch.float64)
    for name, act in table.items():  # the model's function and the reference's formula agree
        assert torch.allclose(act.fn(x), reference.ACTIVATIONS[name](x), atol=1e-12), name


# --- finding 7 and issue 38 item 8: check -----------------------------------------------------------------------------

CHECK_FILE = '''
import torch
from torch import nn
from tests.userclass import book


def make_model(cfg):
    return book.GPTModel(book.config({"vocab_size": cfg.vocab_size, "n_positions": cfg.n_positions,
                                      "n_embd": cfg.n_embd, "n_head": cfg.n_head, "n_layer": cfg.n_layer}))


def make_with_tokenizer(cfg, tokenizer):
    return make_model(cfg)


class Empty(nn.Module):
    def forward(self, idx):
        return idx


def make_empty():
    return Empty()
'''


@pytest.fixture
def check_file(tmp_path):
    path = tmp_path / "mygpt.py"
    path.write_text(CHECK_FILE)
    return path


@pytest.mark.parametrize("which", ["hf", "checkpoint whose source is gone"])
def test_check_defaults_its_reference_to_ckpt(which, check_file, real_hf, tmp_path, monkeypatch):
    from tests.support import run_cli

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    ckpt = real_hf
    if which != "hf":
        import shutil

        gone = tmp_path / "gone"
        shutil.copytree(real_hf, gone)
        ckpt = tmp_path / "ckpt"
        gpt2port.convert(gone, ckpt)
        shutil.rmtree(gone)
    r = run_cli("check", f"{check_file}:make_model", ckpt, "--tokens", "8", "--no-hf")
    assert r.exit_code == 0, r.output
    assert "PASS" in r.stdout.splitlines()[-1]


def test_check_names_a_factory_signature_as_the_users_error(check_file, real_ckpt):
    from tests.support import run_cli

    r = run_cli("check", f"{check_file}:make_with_tokenizer", real_ckpt, "--no-hf")
    assert r.exit_code == 1 and "internal error" not in r.stderr, r.stderr
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and f"{check_file.name}:12: make_with_tokenizer" in line[0] and "'tokenizer'" in line[0]


def test_check_refuses_a_model_without_parameters_on_stderr(check_file, real_ckpt):
    from tests.support import run_cli

    r = run_cli("check", f"{check_file}:make_empty", real_ckpt, "--no-hf")
    assert r.exit_code == 1
    assert "error:" in r.stderr and "no parameters" in r.stderr and "no parameters" not in r.stdout


def test_check_refuses_a_class_on_stderr_after_its_table(real_ckpt, tmp_path):
    """A class that cannot hold GPT-2 (a ReLU MLP): the table on stdout, the reasons on stderr after `error:`."""
    from tests.support import assert_one_line_error, run_cli

    path = tmp_path / "relu.py"
    path.write_text(CHECK_FILE + "\n\ndef make_relu(cfg):\n    m = make_model(cfg)\n    for b in m.trf_blocks:\n"
                    "        b.ff.layers[1] = nn.ReLU()\n    return m\n")
    r = run_cli("check", f"{path}:make_relu", real_ckpt, "--no-hf")
    assert r.exit_code == 1
    # check's step lines go to stderr too (progress on stderr, results on stdout); the error is the one other line
    line = assert_one_line_error(r.exit_code, r.stderr, r.stdout)
    assert "tok_emb.weight" in r.stdout and "measures as ReLU" in line, r.stderr


def test_check_help_says_the_file_is_run():
    from tests.support import run_cli

    assert "imported and run" in " ".join(run_cli("check", "--help").output.split())
