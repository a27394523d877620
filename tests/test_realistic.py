"""The realistic-scale fixture does what tests rely on it for: large pre-activations, told-apart activations."""

import torch

from scripts.hf_fixtures import TINY
from tests.realistic import activation_stats, realistic_hf_model


def test_realistic_scales_separate_what_small_init_hides():
    idx = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(1))
    model = realistic_hf_model(TINY, seed=0)
    stats = activation_stats(model, idx)
    assert 1.5 < stats["qkv"] < 3.5 and 1.5 < stats["fc"] < 3.5, stats
    with torch.no_grad():
        tanh = model(idx).logits
        erf = realistic_hf_model(TINY, seed=0, activation_function="gelu")(idx).logits
        relu = realistic_hf_model(TINY, seed=0, activation_function="relu")(idx).logits
    assert (erf - tanh).abs().max() > 5e-4  # far above fp32 noise: verify can tell tanh from erf GELU
    assert (relu - tanh).abs().max() > 0.1
    assert all(p.abs().min() > 0 or p.numel() < 4 for n, p in model.named_parameters() if n.endswith("bias"))
