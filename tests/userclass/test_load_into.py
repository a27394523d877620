"""gpt2port.load_into pours GPT-2 into a user's own GPT class, whatever its names, containers and conventions, or
refuses with every reason at once. Each class in tests/userclasses is filled and checked three ways: its logits
against gpt2port's GPT on the same checkpoint, its every parameter against the loader a learner writes by hand
(hand_load, proven in test_userclasses.py), and its own Parameter objects kept (an optimizer made before still
holds them)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from safetensors.torch import load_file

import gpt2port
from gpt2port import GPT, GPT2PortError, layout_of, load_into, save_from
from gpt2port.checkpoint import load_state
from tests.userclasses import BIASLESS, FAITHFUL, NANOCHAT, NANOGPT_ERF, Case, amplify_mlp, module

TOL = dict(rtol=1e-5, atol=1e-5)
SAVE_CASES = [Case("syds"), Case("llms", {"qkv_bias": True}), Case("mingpt"), Case("opaque")]


def tokens(config, T=16, B=2):
    return torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))


def logits_of(case, model, idx):
    with torch.no_grad():
        return case.logits(model.eval(), idx)


def assert_same_as_hand_load(case, model, ckpt, **build):
    """Every parameter equals, bit for bit, what the hand-written loader puts there."""
    _, config, canonical = load_state(ckpt)
    twin = case.build(config, **build)
    case.hand_load(twin, canonical)
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in twin.named_parameters()]
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), twin.get_parameter(name).detach()), name


def reason_lines(err) -> list[str]:
    return [line for line in str(err.value).splitlines() if line.strip()]


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    model = GPT.from_pretrained(tiny_ckpt)
    return lambda idx: model(idx)[0]


@pytest.fixture(scope="module")
def config(tiny_ckpt):
    return load_state(tiny_ckpt)[1]


# --- faithful classes ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", FAITHFUL, ids=lambda c: c.id)
def test_faithful_class_loads_and_computes_gpt2(case, tiny_ckpt, reference, config):
    model = case.build(config)
    ids_before = {n: id(p) for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    report = load_into(model, tiny_ckpt)
    assert {n: id(p) for n, p in model.named_parameters()} == ids_before
    held = [p for g in optimizer.param_groups for p in g["params"]]
    assert all(a is b for a, b in zip(held, model.parameters()))
    assert_same_as_hand_load(case, model, tiny_ckpt)
    idx = tokens(config)
    torch.testing.assert_close(logits_of(case, model, idx), reference(idx), **TOL)
    assert report.config == config
    assert str(report.layout).strip()
    assert isinstance(report.notes, list) and all(isinstance(n, str) for n in report.notes)
    assert report.cost is None
    assert report.proof["passed"] and report.proof["rel"] <= 1e-5  # every load carries its measured agreement
    assert "proof: logits equal GPT-2's to" in str(report)


def test_head_bias_is_zeroed_and_said(tiny_ckpt, config):
    model = Case("opaque").build(config)
    with torch.no_grad():
        model.lm_head.bias.fill_(3.0)
    report = load_into(model, tiny_ckpt)
    assert torch.equal(model.lm_head.bias, torch.zeros_like(model.lm_head.bias))
    assert any("lm_head" in n and "bias" in n for n in report.notes), report.notes


def test_untied_head_gets_a_copy_unless_tie_is_asked(tiny_ckpt, reference, config):
    case = Case("syds")
    kept = case.build(config)
    report = load_into(kept, tiny_ckpt)  # tie=None keeps the class's choice: untied
    assert kept.output_projection.weight is not kept.token_embedding.weight
    assert torch.equal(kept.output_projection.weight, kept.token_embedding.weight)
    assert any("output_projection" in n for n in report.notes), report.notes
    separate = case.build(config)
    load_into(separate, tiny_ckpt, tie=False)
    assert separate.output_projection.weight is not separate.token_embedding.weight

    tied = case.build(config)
    load_into(tied, tiny_ckpt, tie=True)
    assert tied.output_projection.weight is tied.token_embedding.weight
    assert len(list(tied.parameters())) == len(list(kept.parameters())) - 1
    idx = tokens(config)
    torch.testing.assert_close(logits_of(case, tied, idx), reference(idx), **TOL)


def test_loads_from_a_hugging_face_directory(make_hf_repo, tiny_ckpt, reference, config):
    case = Case("mingpt")
    model = case.build(config)
    load_into(model, make_hf_repo("hub"))
    assert_same_as_hand_load(case, model, tiny_ckpt)


@pytest.mark.parametrize("case", [Case("syds"), Case("opaque"), Case("anonymous"), Case("conv1d_style")],
                         ids=lambda c: c.id)
def test_class_built_on_the_meta_device(case, tiny_ckpt, reference, config):
    with torch.device("meta"):
        model = case.build(config)
    load_into(model, tiny_ckpt)
    assert not any(p.is_meta for p in model.parameters())
    idx = tokens(config)
    torch.testing.assert_close(logits_of(case, model, idx), reference(idx), **TOL)


# --- close but not GPT-2 -------------------------------------------------------------------------------------------

def test_nanogpt_erf_gelu_loads_but_is_not_exact(tiny_ckpt, tmp_path, config):
    loud = amplify_mlp(tiny_ckpt, tmp_path / "loud")
    model = NANOGPT_ERF.build(config)
    load_into(model, loud)
    assert_same_as_hand_load(NANOGPT_ERF, model, loud)
    idx = tokens(config)
    gap = (logits_of(NANOGPT_ERF, model, idx) - GPT.from_pretrained(loud)(idx)[0]).abs().max().item()
    assert 1e-5 < gap < 1e-2


# (verify_model naming nanoGPT's erf GELU through the class's own modules: tests/verification/test_diagnose.py, on
# weights of GPT-2's magnitudes, where the difference shows.)


# --- refusals ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", BIASLESS, ids=lambda c: c.id)
def test_biasless_class_is_refused_naming_its_modules(case, tiny_ckpt, config):
    model = case.build(config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(GPT2PortError) as err:
        load_into(model, tiny_ckpt)
    message = str(err.value)
    # Linears (other than the head, which GPT-2 builds without a bias too) that have nowhere for GPT-2's bias
    head = {id(m) for n, m in model.named_modules() if n in ("lm_head", "head", "out_head", "output_projection")}
    biasless = [n for n, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and m.bias is None and id(m) not in head]
    assert biasless
    for leaf in {n.rsplit(".", 1)[-1] for n in biasless}:
        assert re.search(rf"\b{re.escape(leaf)}\b", message), (leaf, message)
    assert any(re.sub(r"\.\d+\.", ".*.", n) in re.sub(r"\.\d+\.", ".*.", message) for n in biasless), message
    assert "drop_biases" in message
    # a refusal changes nothing
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("case", BIASLESS, ids=lambda c: c.id)
def test_biasless_class_loads_when_biases_may_be_dropped(case, tiny_ckpt, config):
    model = case.build(config)
    report = load_into(model, tiny_ckpt, drop_biases=True)
    assert_same_as_hand_load(case, model, tiny_ckpt)
    cost = report.cost
    assert isinstance(cost, dict) and cost
    numbers = {k: float(v) for k, v in cost.items() if isinstance(v, (int, float))}
    assert numbers and all(math.isfinite(v) for v in numbers.values()), cost
    assert 0.0 <= cost["greedy_agreement"] <= 1.0 and 0.0 <= cost["top1"] <= 1.0, cost
    assert cost["kl_mean"] >= 0.0 and cost["max_rel"] > 1e-3, cost  # what the missing biases cost, measured
    assert "cost of the dropped biases" in str(report)


def test_nanochat_is_refused_with_every_reason(tiny_ckpt):
    model = module(NANOCHAT.style).build()  # its own defaults: 65,536 tokens
    with pytest.raises(GPT2PortError) as err:
        load_into(model, tiny_ckpt)
    lines = reason_lines(err)
    message = "\n".join(lines).lower()
    assert len(lines) >= 4, lines
    assert "position" in message or "rotary" in message
    assert "norm" in message
    assert "bias" in message
    assert "65536" in message.replace(",", "") and "50257" in message.replace(",", "")


def test_short_position_table_needs_crop_positions(tiny_ckpt, reference, config):
    case = Case("syds")
    model = case.build(config, block_size=32)
    with pytest.raises(GPT2PortError) as err:
        load_into(model, tiny_ckpt)
    assert "crop_positions" in str(err.value)
    report = load_into(model, tiny_ckpt, crop_positions=True)
    assert any("32" in n and "64" in n for n in report.notes), report.notes
    assert_same_as_hand_load(case, model, tiny_ckpt, block_size=32)
    idx = tokens(config, T=32)
    torch.testing.assert_close(logits_of(case, model, idx), reference(idx), **TOL)


@pytest.mark.parametrize("shape", [{"n_embd": 48}, {"vocab_size": 1000}], ids=["width", "vocab"])
def test_wrong_shape_is_refused_with_the_config_to_build(shape, tiny_ckpt, config):
    import dataclasses

    model = Case("syds").build(dataclasses.replace(config, **shape))
    with pytest.raises(GPT2PortError) as err:
        load_into(model, tiny_ckpt)
    message = str(err.value)
    for key in ("n_embd", "vocab_size", "n_layer", "n_head"):
        assert re.search(rf"{key}\D{{0,4}}{getattr(config, key)}\b", message), (key, message)


# --- layout_of and save_from ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", FAITHFUL, ids=lambda c: c.id)
def test_layout_table_names_each_parameter_once(case, config):
    """One row per parameter; block 0's rows stand for every block, the block index written {i}."""
    model = case.build(config)
    layout = layout_of(model)
    rows = [line.split()[0] for line in str(layout).splitlines()[2:] if line.split()
            and not line.startswith(("decided:", "note:", "cannot hold"))]
    blocks = re.escape(layout.modules.blocks)
    for name, _ in model.named_parameters():
        row = re.sub(rf"^{blocks}\.\d+\.", layout.modules.blocks + ".{i}.", name)
        assert rows.count(row) == 1, (row, str(layout))


@pytest.mark.parametrize("case", SAVE_CASES, ids=lambda c: c.id)
def test_save_from_gives_back_the_checkpoint_bit_for_bit(case, tiny_ckpt, tmp_path, config):
    model = case.build(config)
    load_into(model, tiny_ckpt)
    out = save_from(model, tmp_path / "back")
    source = load_file(str(tiny_ckpt / "model.safetensors"))
    saved = load_file(str(out / "model.safetensors"))
    assert sorted(saved) == sorted(source)  # an equal untied head and a zero head bias add nothing
    for name, t in source.items():
        assert saved[name].dtype == t.dtype and torch.equal(saved[name], t), name


def test_untied_head_format_keeps_a_changed_head(tiny_ckpt, tmp_path, config):
    """The checkpoint format holding an untied head: a head trained apart from the embedding survives save_from
    and GPT.from_pretrained."""
    case = Case("syds")
    model = case.build(config)
    load_into(model, tiny_ckpt)
    with torch.no_grad():
        model.output_projection.weight[7] += 1.0
    out = save_from(model, tmp_path / "untied")
    saved = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" in saved
    assert torch.equal(saved["lm_head.weight"], model.output_projection.weight.detach())
    idx = tokens(config)
    changed = logits_of(case, model, idx)
    assert (changed - GPT.from_pretrained(tiny_ckpt)(idx)[0]).abs().max().item() > 1e-2
    torch.testing.assert_close(GPT.from_pretrained(out)(idx)[0], changed, **TOL)


# --- full size -----------------------------------------------------------------------------------------------------

@pytest.mark.heavy  # a second size of a check the default run makes on the tiny model
@pytest.mark.fullsize
def test_124m_shape_meta_built(gpt2_ckpt):
    reference = GPT.from_pretrained(gpt2_ckpt)
    config = reference.config
    idx = tokens(config, T=8, B=1)
    want = reference(idx)[0]
    for case in (Case("syds"), Case("nanogpt", {"gelu": "tanh"})):
        with torch.device("meta"):
            model = case.build(config)
        load_into(model, gpt2_ckpt)
        torch.testing.assert_close(logits_of(case, model, idx), want, **TOL)
        del model


# --- what else a person who wrote their own GPT expects --------------------------------------------------------------

def test_a_relu_mlp_is_not_gpt2(tiny_ckpt, config):
    case = Case("lecture", {"bias": True, "act": "relu"})
    with pytest.raises(GPT2PortError, match=r"blocks.0.ffwd.*: the activation .* measures as ReLU"):
        load_into(case.build(config), tiny_ckpt)
    with gpt2port.init_empty():  # built without values, it is measured once filled
        model = case.build(config)
    with pytest.raises(GPT2PortError, match=r"blocks.0.ffwd.*: the activation .* measures as ReLU"):
        load_into(model, tiny_ckpt)


def test_tie_false_on_a_tied_class_is_refused(tiny_ckpt, config):
    with pytest.raises(GPT2PortError, match="tie=False, but the class ties its head"):
        load_into(Case("kader", {"bias": True}).build(config), tiny_ckpt, tie=False)


def test_verify_model_judges_a_users_class_stage_by_stage(tiny_ckpt, make_hf_repo, config):
    model = Case("syds").build(config)
    load_into(model, tiny_ckpt)
    report = gpt2port.verify_model(model, make_hf_repo("hub"), tokens=16, hf=False)
    assert report.passed, report.to_text()
    stages = {s["stage"] for s in report.localization["stages"]}
    assert {"embeddings", "block 1 attention", "block 1 MLP", "final norm", "head"} <= stages


def test_layout_of_reads_split_qkv_as_parts_of_the_fused_projection(config):
    text = str(layout_of(Case("llms", {"qkv_bias": True}).build(config)))
    assert "trf_blocks.{i}.att.W_key.weight     blocks.{i}.attn.qkv.weight   part(1/3)" in text


def test_a_head_count_that_differs_is_refused(tiny_ckpt, config):
    """Every shape fits a class built with 2 heads instead of 4; its attention module's n_head says otherwise."""
    import dataclasses

    model = Case("kader", {"bias": True}).build(dataclasses.replace(config, n_head=2))
    with pytest.raises(GPT2PortError, match=r"blocks.0.attn.n_head = 2; GPT-2 has 4 heads"):
        load_into(model, tiny_ckpt)


class _InlineBlock(torch.nn.Module):
    """Attention written inline in the block's forward: its Linears sit in the block, no attention module."""

    def __init__(self, c):
        super().__init__()
        C = c.n_embd
        self.ln_1, self.ln_2, self.n_head = torch.nn.LayerNorm(C), torch.nn.LayerNorm(C), c.n_head
        self.c_attn, self.c_proj = torch.nn.Linear(C, 3 * C), torch.nn.Linear(C, C)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(C, 4 * C), torch.nn.GELU(approximate="tanh"),
                                       torch.nn.Linear(4 * C, C))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.c_attn(self.ln_1(x)).split(C, 2))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln_2(x))


class _InlineGPT(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(c.vocab_size, c.n_embd), torch.nn.Embedding(c.n_positions, c.n_embd)
        self.h = torch.nn.ModuleList(_InlineBlock(c) for _ in range(c.n_layer))
        self.ln_f = torch.nn.LayerNorm(c.n_embd)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.h:
            x = b(x)
        return self.ln_f(x) @ self.wte.weight.t()  # the tied head, inline


def test_attention_written_inline_is_verified_stage_by_stage(tiny_ckpt, make_hf_repo, config):
    model = _InlineGPT(config)
    load_into(model, tiny_ckpt)
    report = gpt2port.verify_model(model, make_hf_repo("hub"), tokens=16, hf=False)
    assert report.passed, report.to_text()
    assert {"block 1 attention", "block 1 MLP"} <= {s["stage"] for s in report.localization["stages"]}
    with torch.no_grad():
        model.h[1].c_proj.bias += 0.01  # a bug in the inline attention is named at its stage
    broken = gpt2port.verify_model(model, make_hf_repo("hub"), tokens=16, hf=False)
    assert broken.localization["first_divergence"].startswith("block 1: attention output differs")
