"""`gpt2port check FILE.py:FACTORY`, init_empty, and the parts of load_into that no model class shows by itself:
ambiguity settled by numbers (and refused when no reading computes GPT-2), the activation measured, a meta-built
class sharing the checkpoint's mapped tensors without ever writing to the file."""

from __future__ import annotations

import hashlib
import re
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


def test_check_steps_go_to_stderr_and_the_results_to_stdout(user_file, tiny_ckpt):
    r = run_cli("check", f"{user_file}:make", tiny_ckpt, "--tokens", "16", "--no-hf")
    assert r.exit_code == 0, r.output
    assert "check [" not in r.stdout and "PASS" in r.stdout.splitlines()[-1]
    assert [line.split("]")[0] for line in r.stderr.splitlines() if line.startswith("check [")][:4] == \
        ["check [1/4", "check [2/4", "check [3/4", "check [4/4"], r.stderr


def test_a_long_check_step_says_so_again(capsys):
    import time

    from gpt2port.userclass.check import Steps

    step = Steps(2, every=0.1)
    step("loading")
    time.sleep(0.5)
    step("verifying", beat=False)  # speaks for itself
    time.sleep(0.5)
    step.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("check [1/2]") and lines[0].endswith(": loading")
    assert sum(line.endswith("loading (still working)") for line in lines) >= 2
    assert lines[-1].endswith(": verifying")


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
        torch.testing.assert_close(model(ids)[0], ours(ids)[0], rtol=1e-5, atol=1e-5)
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
        assert not torch.allclose(model(ids)[0], fresh(ids)[0])


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
        want = GPT.from_pretrained(tiny_ckpt)(ids)[0]
        torch.testing.assert_close(case.logits(model, ids), want, rtol=1e-5, atol=1e-5)


def test_a_meta_buffer_that_is_no_mask_is_refused(tiny_ckpt):
    from gpt2port.checkpoint import read_config

    with torch.device("meta"):
        model = GPT(read_config(tiny_ckpt))
        model.blocks[0].attn.register_buffer("table", torch.zeros(4, 3))
    with pytest.raises(gpt2port.GPT2PortError, match="blocks.0.attn.table: a buffer on the meta device .* no causal "
                                                     "mask to rebuild.*init_empty"):
        gpt2port.load_into(model, tiny_ckpt)


# --- check speaks to its user ------------------------------------------------------------------------------------
# A file in the style of the tutorials: a dict config read by the tutorials' own key names, a hand-written
# LayerNorm with scale/shift, separate query/key/value projections; plus factories that fail in the user's code.
TUTORIAL_FILE = textwrap.dedent('''
    import torch
    from torch import nn

    class Norm(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.scale, self.shift = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

        def forward(self, x):
            m, v = x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)
            return self.scale * (x - m) / torch.sqrt(v + 1e-5) + self.shift

    class Attention(nn.Module):
        def __init__(self, config):
            super().__init__()
            d, self.heads = config["embedding_dim"], config["num_heads"]
            self.W_query = nn.Linear(d, d, bias=config["qkv_bias"])
            self.W_key = nn.Linear(d, d, bias=config["qkv_bias"])
            self.W_value = nn.Linear(d, d, bias=config["qkv_bias"])
            self.out_proj = nn.Linear(d, d)
            self.register_buffer("mask", torch.triu(torch.ones(config["context_length"], config["context_length"]), 1))

        def forward(self, x):
            b, n, d = x.shape
            q, k, v = (f(x).view(b, n, self.heads, d // self.heads).transpose(1, 2)
                       for f in (self.W_query, self.W_key, self.W_value))
            s = (q @ k.transpose(2, 3)).masked_fill(self.mask.bool()[:n, :n], -torch.inf) / (d // self.heads) ** 0.5
            return self.out_proj((torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, n, d))

    class Block(nn.Module):
        def __init__(self, config):
            super().__init__()
            d = config["emb_dim"]
            self.att, self.norm1, self.norm2 = Attention(config), Norm(d), Norm(d)
            self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
            self.drop = nn.Dropout(config["drop_rate"])

        def forward(self, x):
            x = x + self.drop(self.att(self.norm1(x)))
            return x + self.drop(self.ff(self.norm2(x)))

    class Model(nn.Module):
        def __init__(self, config, limit=None):
            super().__init__()
            self.limit = limit
            self.tok_emb = nn.Embedding(config["vocab_size"], config["emb_dim"])
            self.pos_emb = nn.Embedding(config["context_length"], config["emb_dim"])
            self.blocks = nn.Sequential(*[Block(config) for _ in range(config["n_layers"] if "n_layers" in config
                                                                        else config["num_layers"])])
            self.final_norm = Norm(config["n_heads"] * (config["emb_dim"] // config.num_heads))
            self.out_head = nn.Linear(config["emb_dim"], config["vocab_size"], bias=False)

        def forward(self, idx):
            n = idx.shape[1]
            if self.limit is not None and n > self.limit:
                raise ValueError(f"sequence of {n} tokens is longer than {self.limit}")
            x = self.tok_emb(idx) + self.pos_emb(torch.arange(n))
            return self.out_head(self.final_norm(self.blocks(x)))

    def make(config):
        return Model(config)

    def make_short(config):  # a context of 32: GPT-2's first 32 positions
        config["context_length"] = 32
        return Model(config)

    def make_tied(config):
        model = Model(config)
        return model

    def read_config(config):
        return config["layers_per_stage"]

    def make_typo(config):
        return read_config(config)

    def make_limited(config):
        return Model(config, limit=12)
''')

BIAS_FREE_FILE = textwrap.dedent('''
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            d, self.n_head = cfg.n_embd, cfg.n_head
            self.ln_1, self.ln_2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)
            self.c_attn, self.c_proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
            self.c_fc, self.c_out = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                       for t in self.c_attn(self.ln_1(x)).split(C, 2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
            x = x + self.c_proj(y)
            return x + self.c_out(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(cfg.vocab_size, cfg.n_embd), nn.Embedding(cfg.block_size, cfg.n_embd)
            self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.n_embd, bias=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for b in self.h:
                x = b(x)
            return self.ln_f(x) @ self.wte.weight.t()
''')


@pytest.fixture
def tutorial_file(tmp_path):
    path = tmp_path / "tutorial_gpt.py"
    path.write_text(TUTORIAL_FILE)
    return path


def test_check_config_answers_to_the_tutorials_key_names(tutorial_file, tiny_ckpt):
    r = run_cli("check", f"{tutorial_file}:make", tiny_ckpt, "--tokens", "16", "--no-hf")
    assert r.exit_code == 0, r.output
    assert "PASS" in r.output.splitlines()[-1]
    steps = [line for line in r.output.splitlines() if line.startswith("check [")]
    assert [s.split("]")[0] for s in steps] == ["check [1/4", "check [2/4", "check [3/4", "check [4/4"], steps


def test_an_error_in_the_users_file_is_theirs_with_file_and_line(tutorial_file, tiny_ckpt):
    from tests.support import assert_clean_failure

    r = run_cli("check", f"{tutorial_file}:make_typo", tiny_ckpt, "--no-hf")
    line = assert_clean_failure(r, names=["tutorial_gpt.py:"])
    lineno = TUTORIAL_FILE.splitlines().index('    return config["layers_per_stage"]') + 1
    assert f"tutorial_gpt.py:{lineno}: KeyError: 'layers_per_stage'" in line
    assert "in read_config <- tutorial_gpt.py:" in line and "in make_typo" in line
    assert "internal error" not in line and "please report" not in line
    # raised by the model's forward on 16 tokens (load_into's closing proof runs it first): still theirs, and said when
    r = run_cli("check", f"{tutorial_file}:make_limited", tiny_ckpt, "--tokens", "16", "--no-hf")
    line = assert_clean_failure(r, names=["tutorial_gpt.py:"])
    assert re.search(r"tutorial_gpt.py:\d+: ValueError: sequence of \d+ tokens is longer than 12", line), line
    assert "while loading" in line and "in forward" in line


def test_a_file_that_exits_at_import_is_an_error_not_a_pass(tmp_path, tiny_ckpt):
    from tests.support import assert_clean_failure

    script = tmp_path / "train.py"
    script.write_text("import sys\n\ndef make(cfg):\n    return None\n\nsys.exit(0)\n")
    r = run_cli("check", f"{script}:make", tiny_ckpt, "--no-hf")
    line = assert_clean_failure(r, names=["train.py", "SystemExit(0)", "train.py:6"])
    assert "__main__" in line


def test_a_bias_free_class_is_refused_once_per_reason_and_loads_with_drop_biases(tmp_path, tiny_ckpt):
    path = tmp_path / "biasfree.py"
    path.write_text(BIAS_FREE_FILE)
    r = run_cli("check", f"{path}:GPT", tiny_ckpt, "--no-hf")
    assert r.exit_code == 1
    refusal = r.stderr[r.stderr.index("cannot hold these GPT-2 weights"):].splitlines()  # after `error:`
    assert "(1 reason)" in refusal[0] and len(refusal) == 1 and r.output.count("no bias, but") == 1, r.output
    assert "ln_f, h.0.ln_1, h.0.ln_2" in refusal[0] and "pass --drop-biases" in refusal[0]
    assert "RMSNorm" not in r.output and "drop_biases=True" not in r.output
    assert "cannot hold GPT-2:" not in r.output  # the table does not say the reasons a second time
    r = run_cli("check", f"{path}:GPT", tiny_ckpt, "--no-hf", "--drop-biases", "--tokens", "16")
    assert "GPT-2's biases dropped on request (--drop-biases)" in r.output, r.output
    assert "cost of the dropped biases vs GPT-2" in r.output
    assert "FAIL" in r.output and r.exit_code == 1  # without its biases it is not GPT-2, and check says so


def test_check_takes_crop_positions_and_tie(tutorial_file, tiny_ckpt):
    r = run_cli("check", f"{tutorial_file}:make_short", tiny_ckpt, "--tokens", "16", "--no-hf")
    assert r.exit_code == 1 and "pass --crop-positions to keep the first 32" in r.output, r.output
    r = run_cli("check", f"{tutorial_file}:make_short", tiny_ckpt, "--tokens", "16", "--no-hf", "--crop-positions")
    assert "kept the first 32 of the checkpoint's 64 positions (--crop-positions)" in r.output, r.output
    assert "cannot hold" not in r.output  # loaded (whether verify then accepts the shorter table is verify's part)
    r = run_cli("check", f"{tutorial_file}:make_tied", tiny_ckpt, "--tokens", "16", "--no-hf", "--tie")
    assert r.exit_code == 0 and "out_head.weight: tied to the token embedding on request (--tie)" in r.output, r.output


def test_factory_config_reads_every_tutorial_name():
    from gpt2port.userclass.check import FactoryConfig

    cfg = FactoryConfig(**gpt2port.GPTConfig(n_layer=3, n_head=4, n_embd=32, n_positions=64).to_dict())
    want = {"embedding_dim": 32, "emb_dim": 32, "n_embd": 32, "d_model": 32, "num_heads": 4, "n_heads": 4, "n_head": 4,
            "num_layers": 3, "n_layers": 3, "n_layer": 3, "context_length": 64, "block_size": 64, "n_positions": 64,
            "vocab_size": 50257, "drop_rate": 0.0, "dropout": 0.0, "qkv_bias": True, "bias": True, "head_size": 8}
    for key, value in want.items():
        assert cfg[key] == value and getattr(cfg, key) == value and cfg.get(key) == value, key
    assert {**cfg}["emb_dim"] == 32 and "n_heads" in cfg and "nonsense" not in cfg
    cfg["emb_dim"] = 48
    assert cfg.n_embd == 48
