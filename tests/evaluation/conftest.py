"""Fixtures of the eval tests: realistic-scale weights (tests/realistic.py) and real English text that ships with the
operating system or the Python interpreter (a license), never text written for the tests."""

from __future__ import annotations

import json
import re
import sysconfig
from pathlib import Path

import pytest
import torch

from scripts.hf_fixtures import TINY, write_repo
from tests.realistic import realistic_checkpoint, realistic_hf_model

CONTEXT = TINY["n_positions"]  # 64: windows of a tiny model are short, so a few KB of text make many of them


def english() -> str:
    """The GNU GPL v3 as Debian ships it, or the license text every Python installation ships."""
    for path in (Path("/usr/share/common-licenses/GPL-3"), Path(sysconfig.get_path("stdlib")) / "LICENSE.txt"):
        if path.is_file():
            return path.read_text(encoding="utf-8")
    pytest.skip("no license text on this machine")


def sentences(text: str, min_words: int = 6) -> list[str]:
    """The text's sentences, whitespace collapsed."""
    flat = " ".join(text.split())
    return [s.strip() for s in re.split(r"(?<=[.;:])\s+", flat) if len(s.split()) >= min_words]


@pytest.fixture(scope="session")
def realistic(tmp_path_factory):
    """(hf directory, gpt2port checkpoint) of one realistic-scale tiny model."""
    return realistic_checkpoint(tmp_path_factory.mktemp("eval-model"), TINY, seed=0)


@pytest.fixture(scope="session")
def tuned_hf(tmp_path_factory):
    """The same model moved a little, as a fine-tune or a quantization moves it: an HF directory."""
    model = realistic_hf_model(TINY, seed=0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.05)
    out = tmp_path_factory.mktemp("eval-tuned") / "hf"
    write_repo(model, out, "hub", "fp32")
    return out


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval-text") / "license.txt"
    path.write_text(english()[:6000], encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def lambada_file(tmp_path_factory):
    """LAMBADA's layout: one {"text": ...} per line, the last word the one to predict."""
    path = tmp_path_factory.mktemp("eval-lambada") / "lambada.jsonl"
    rows = [json.dumps({"text": s.rstrip(".;:")}) for s in sentences(english())[:60]]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def hellaswag_file(tmp_path_factory):
    """HellaSwag's layout from the license's sentences: a sentence's start is the context, its own end and the ends
    of three other sentences are the endings; some contexts carry WikiHow's bracketed markers, as the real file's
    do, for the harness's preprocess to remove."""
    path = tmp_path_factory.mktemp("eval-hellaswag") / "hellaswag.jsonl"
    found = [s.split() for s in sentences(english(), 10) if len(s.split()) <= 40][:160]
    rows = []
    for k in range(len(found) // 4):
        group = found[4 * k : 4 * k + 4]
        cut = [len(w) // 2 for w in group]
        ends = [" ".join(w[c:]) for w, c in zip(group, cut)]
        label = k % 4
        endings = ends[1:label + 1] + [ends[0]] + ends[label + 1:]
        words = group[0][: cut[0]]
        ctx_a, ctx_b = " ".join(words[:-3]), " ".join(words[-3:]).lower()
        if k % 3 == 0:
            ctx_a = ctx_a + " [title]"
        rows.append({"ind": k, "activity_label": " ".join(words[:2]), "ctx_a": ctx_a, "ctx_b": ctx_b,
                     "ctx": ctx_a + " " + ctx_b, "endings": endings, "label": label, "split": "val"})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    return path
