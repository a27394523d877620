"""`gpt2port check FILE.py:FACTORY`, init_empty, and the parts of load_into that no model class shows by itself:
ambiguity settled by numbers (and refused when no reading computes GPT-2), the activation measured, a meta-built
class sharing the checkpoint's mapped tensors without ever writing to the file."""

from __future__ import annotations

import hashlib
import textwrap

import pytest
import torch

import gpt2port
from gpt2port import GPT
from tests.support import run_cli

# A user's file, as `check` imports it: an anonymous-names class (q, k, v as a ModuleList `lin`, run as k, q, v),
# whose weights are raw (in, out) Parameters in the MLP: names and module types leave both open.
USER_FILE = textwrap.dedent('''
    import math
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Attn(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.h = c.n_head
            self.lin = nn.ModuleList(nn.Linear(c.n_embd, c.n_embd) for _ in range(3))
            self.out = nn.Linear(c.n_embd, c.n_embd)

        def forward(self, x):
            B, T, C = x.shape
            k, q, v = (m(x).view(B, T, self.h, C // self.h).transpose(1, 2) for m in self.lin)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=getattr(self, "scale", None))
            return self.out(y.transpose(1, 2).reshape(B, T, C))

    class MLP(nn.Module):
        def __init__(self, c, act):
            super().__init__()
            self.w_in = nn.Parameter(torch.randn(c.n_embd, 4 * c.n_embd) * 0.5)
            self.b_in = nn.Parameter(torch.zeros(4 * c.n_embd))
            self.w_out = nn.Parameter(torch.randn(4 * c.n_embd, c.n_embd) * 0.02)
            self.b_out = nn.Parameter(torch.zeros(c.n_embd))
            self.act = act

        def forward(self, x):
            return self.act(x @ self.w_in + self.b_in) @ self.w_out + self.b_out

    class Block(nn.Module):
        def __init__(self, c, act):
            super().__init__()
            self.n1, self.attn, self.n2, self.mlp = nn.LayerNorm(c.n_embd), Attn(c), nn.LayerNorm(c.n_embd), MLP(c, act)

        def forward(self, x):
            x = x + self.attn(self.n1(x))
            return x + self.mlp(self.n2(x))

    class Net(nn.Module):
        def __init__(self, c, act=lambda x: F.gelu(x, approximate="tanh")):
            super().__init__()
            self.tok = nn.Embedding(c["vocab_size"], c.emb_dim)
            self.pos = nn.Embedding(c.context_length, c.emb_dim)
            self.layers = nn.ModuleList(Block(c, act) for _ in range(c.n_layers))
            self.norm = nn.LayerNorm(c.emb_dim)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for b in self.layers:
                x = b(x)
            return self.norm(x) @ self.tok.weight.t(), None

    def make(cfg):
        return Net(cfg)

    def make_relu(cfg):
        return Net(cfg, act=F.relu)

    def make_softsign(cfg):  # an activation that is none of the known ones
        return Net(cfg, act=F.softsign)

    def make_unscaled(cfg):  # attention without 1/sqrt(d): no reading of q, k, v computes GPT-2
        net = Net(cfg)
        for b in net.layers:
            b.attn.scale = 1.0
        return net
''')


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "mygpt.py"
    path.write_text(USER_FILE)
    return path


def _load_file(path):
    from gpt2port.userclass.check import load_factory

    return load_factory(f"{path}:make")


def test_check_passes_and_prints_the_table_and_the_verdict(user_file, tiny_ckpt):
    r = run_cli("check", f"{user_file}:make", tiny_ckpt, "--tokens", "16", "--no-hf")
    assert r.exit_code == 0, r.output
    assert "layers.{i}.attn.lin.0.weight  blocks.{i}.attn.qkv.weight   part(1/3)" in r.output
    assert "decided: which of q, k, v is which" in r.output  # settled by numbers, and said so
    assert "PASS" in r.output.splitlines()[-1]


def test_check_refuses_a_relu_mlp_with_the_reason(user_file, tiny_ckpt):
    r = run_cli("check", f"{user_file}:make_relu", tiny_ckpt, "--no-hf")
    assert r.exit_code == 1
    assert "measures as ReLU" in r.output and "layers.0.mlp" in r.output


def test_check_names_a_bad_factory_in_one_line(user_file, tiny_ckpt):
    r = run_cli("check", f"{user_file}:nothing_here", tiny_ckpt)
    assert r.exit_code == 1 and "has no function or class 'nothing_here'" in r.stderr


def test_settled_by_numbers_matches_gpt2port(user_file, tiny_ckpt):
    from gpt2port.config import GPTConfig
    from gpt2port.checkpoint import read_config
    from gpt2port.userclass.check import FactoryConfig, build

    model = build(_load_file(user_file), read_config(tiny_ckpt), None)
    report = gpt2port.load_into(model, tiny_ckpt)
    decided = "\n".join(report.layout.decided)
    assert "lin.0=k" in decided and "lin.1=q" in decided and "lin.2=v" in decided
    rows = {a.param: a.transform.name for a in report.layout.assignments}
    assert rows["layers.0.mlp.w_in"] == "transpose"  # raw (in, out) weights: their biases' lengths tell
    ids = torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = GPT.from_pretrained(tiny_ckpt)
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[0], ours(ids), rtol=1e-5, atol=1e-5)
    assert isinstance(FactoryConfig(**GPTConfig().to_dict())["qkv_bias"], bool)


def test_no_reading_computes_gpt2_is_refused_with_the_closest(user_file, tiny_ckpt):
    from gpt2port.checkpoint import read_config
    from gpt2port.userclass.check import build, load_factory

    model = build(load_factory(f"{user_file}:make_unscaled"), read_config(tiny_ckpt), None)
    with pytest.raises(gpt2port.GPT2PortError, match="no reading of the class computes GPT-2.*closest"):
        gpt2port.load_into(model, tiny_ckpt)
    model = build(load_factory(f"{user_file}:make_softsign"), read_config(tiny_ckpt), None)
    with pytest.raises(gpt2port.GPT2PortError, match="layers.0.mlp: .*matches no known activation"):
        gpt2port.load_into(model, tiny_ckpt)


def test_init_empty_puts_parameters_on_meta_and_keeps_buffers(tiny_ckpt):
    class WithMask(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("mask", torch.tril(torch.ones(3, 3)))

    with gpt2port.init_empty():
        m = WithMask()
    assert m.lin.weight.is_meta and m.lin.bias.is_meta
    assert not m.mask.is_meta and torch.equal(m.mask, torch.tril(torch.ones(3, 3)))
    assert not torch.nn.Linear(2, 2).weight.is_meta  # and nothing changed once outside the block


def test_meta_class_shares_the_mapped_checkpoint_and_never_writes_it(user_file, tiny_ckpt):
    from gpt2port.checkpoint import read_config
    from gpt2port.userclass.check import build

    weights = tiny_ckpt / "model.safetensors"
    before = hashlib.sha256(weights.read_bytes()).hexdigest()
    with gpt2port.init_empty():
        model = build(_load_file(user_file), read_config(tiny_ckpt), None)
    gpt2port.load_into(model, tiny_ckpt)
    ids = torch.randint(0, 50257, (1, 12), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(ids)[0].square().mean().backward()
    opt.step()  # changes every shared parameter in place
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == before
    fresh = GPT.from_pretrained(tiny_ckpt)
    with torch.no_grad():
        assert not torch.allclose(model(ids)[0], fresh(ids))


@pytest.mark.parametrize("style", ["syds", "opaque", "anonymous"])  # masks kept either way round
def test_plain_meta_build_gets_its_causal_masks_back(style, tiny_ckpt):
    from gpt2port.checkpoint import read_config
    from tests.userclasses import Case

    case = Case(style)
    with torch.device("meta"):
        model = case.build(read_config(tiny_ckpt))
    report = gpt2port.load_into(model, tiny_ckpt)
    assert any("causal-mask buffers" in d for d in report.layout.decided)
    ids = torch.randint(0, 50257, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(case.logits(model, ids), GPT.from_pretrained(tiny_ckpt)(ids), rtol=1e-5, atol=1e-5)


def test_a_meta_buffer_that_is_no_mask_is_refused(tiny_ckpt):
    from gpt2port.checkpoint import read_config

    with torch.device("meta"):
        model = GPT(read_config(tiny_ckpt))
        model.blocks[0].attn.register_buffer("table", torch.zeros(4, 3))
    with pytest.raises(gpt2port.GPT2PortError, match="blocks.0.attn.table: a buffer on the meta device .* no causal "
                                                     "mask to rebuild.*init_empty"):
        gpt2port.load_into(model, tiny_ckpt)
