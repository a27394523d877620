"""Which from-scratch mistakes verify can see, at which weight scale: each mistake of
tests/verification/test_diagnose.py (plus ReLU for GELU and every bias dropped) made in gpt2port's own GPT, verified
against its source, on weights at the transformers' own init, at the test fixtures' 0.02 init with random LayerNorms and
biases (hf_fixtures.make_hf_model), and at a trained GPT-2's activation scales (tests/realistic.py).

    python -m scripts.verify_sensitivity [--width 32]

Prints a markdown table: detected (verify FAILs) and named (its diagnosis names the mistake) per scale.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch.nn import functional as F

import gpt2port
from gpt2port import GPT
from scripts import hf_fixtures
from tests.realistic import make_realistic_
from tests.verification.test_diagnose import CASES


def relu(m):
    for b in m.blocks:
        b.mlp.act = F.relu


def eps_1e6(m):
    for b in m.blocks:
        b.ln1.eps = b.ln2.eps = 1e-6
    m.final_norm.eps = 1e-6


def no_biases(m):
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("qkv.bias", "proj.bias", "fc.bias")):
                p.zero_()


MISTAKES = {**{k: (v[0], v[2]) for k, v in CASES.items()}, "LayerNorm eps 1e-6 everywhere": (eps_1e6, "eps 1e-06"),
            "ReLU for GELU": (relu, None), "biases dropped": (no_biases, None)}


# transformers' own init (0.02 normal, LayerNorms 1/0, zero biases); the test fixtures' (the same, with random
# LayerNorms and biases); tests/realistic.py
SCALES = ("transformers init", "0.02 init, random LN/biases", "realistic")


def run(width: int) -> str:
    rows = {name: [] for name in MISTAKES}
    with tempfile.TemporaryDirectory() as tmp:
        for scale in SCALES:
            config = hf_fixtures.hf_config(dict(hf_fixtures.TINY, n_embd=width))
            if scale == SCALES[0]:
                from transformers import GPT2LMHeadModel

                torch.manual_seed(21)
                model = GPT2LMHeadModel(config).eval()
            else:
                model = hf_fixtures.make_hf_model(config, seed=21)
            if scale == "realistic":
                make_realistic_(model, seed=21)
            root = Path(tmp) / str(SCALES.index(scale))
            hf_fixtures.write_repo(model, root / "hf", "hub", "fp32", False)
            gpt2port.convert(root / "hf", root / "ckpt")
            for name, (mutate, named) in MISTAKES.items():
                m = GPT.from_pretrained(root / "ckpt")
                mutate(m)
                r = gpt2port.verify_model(m, root / "hf", tokens=16, hf=False)
                d = r.localization["diagnosis"] or {}
                said = "named" if named and named in (d.get("explained_by") or "") else "not named" if named else "-"
                worst = max((s["rel"] for s in r.localization["stages"]), default=float("nan"))
                rows[name].append(f"{'FAIL' if not r.passed else 'passes'} ({worst:.1e}; {said})")
    lines = [f"| mistake (width {width}) | {' | '.join(SCALES)} |", "|---|---|---|---|"]
    lines += [f"| {name} | {' | '.join(cells)} |" for name, cells in rows.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=32)
    print(run(ap.parse_args().width))
