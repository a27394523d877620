"""The tiny GPT-2 at realistic activation scales (tests/realistic.py), as an HF directory and converted; built once."""

from __future__ import annotations

import pytest

import gpt2port
from scripts import hf_fixtures
from tests.realistic import realistic_hf_model


@pytest.fixture(scope="session")
def real_hf(tmp_path_factory):
    repo = tmp_path_factory.mktemp("real-hf")
    hf_fixtures.write_repo(realistic_hf_model(hf_fixtures.TINY, seed=0), repo, "hub", "fp32")
    return repo


@pytest.fixture(scope="session")
def real_ckpt(tmp_path_factory, real_hf):
    out = tmp_path_factory.mktemp("real") / "tiny"
    gpt2port.convert(real_hf, out)
    return out
