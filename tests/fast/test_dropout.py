"""The dropouts gpt2port.fast swaps in: the input itself out of training, nn.Dropout's own draw in training."""

from __future__ import annotations

import torch
import torch.nn as nn

from gpt2port import GPT, GPTConfig
from gpt2port.fast import Settings, accelerate, restore
from gpt2port.fast.kernels import FastDropout

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=48, vocab_size=203, n_positions=32, dropout=0.5)


def dropouts(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.Dropout)]


def test_swapped_dropouts_compute_what_nn_dropout_does():
    torch.manual_seed(0)
    plain = GPT(CONFIG)
    fast = accelerate(GPT(CONFIG), Settings(native=False))
    fast.load_state_dict(plain.state_dict())
    assert len(dropouts(fast)) == len(dropouts(plain)) == 1 + 2 * CONFIG.n_layer
    assert all(type(m) is FastDropout and m.p == 0.5 for m in dropouts(fast))
    idx = torch.tensor([[3, 1, 4, 1, 5]])
    for model in (plain, fast):
        model.train()
    got = []
    for model in (plain, fast):  # in training: the same draws from the same seed
        torch.manual_seed(1)
        got.append(model(idx)[0])
    torch.testing.assert_close(got[1], got[0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        x = torch.randn(4, 8)
        layer = dropouts(fast)[0].eval()
        assert layer(x) is x  # out of training: the input itself, as nn.Dropout returns it
    layer.train()
    restore(fast)
    assert all(type(m) is nn.Dropout and m.p == 0.5 and m.training for m in dropouts(fast))
