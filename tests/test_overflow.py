"""A value beyond the target dtype's range (1e30 into fp16) is refused naming the tensor, never written as Inf."""

from __future__ import annotations

import torch

from scripts.hf_fixtures import TINY, hf_config, make_hf_model, write_repo
from tests.support import assert_clean_failure, run_cli, snapshot


def test_an_export_whose_values_do_not_fit_fp16_is_refused_naming_the_tensor(tmp_path):
    model = make_hf_model(hf_config(TINY))
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] = 1e30
    src = tmp_path / "hf"
    write_repo(model, src, "hub", "fp32")
    before = snapshot(tmp_path)
    line = assert_clean_failure(run_cli("convert", src, "--out", tmp_path / "fp16", "--dtype", "fp16"),
                                ["h.1.mlp.c_fc.weight", "1e+30", "fp16"])
    assert "Inf" in line
    assert snapshot(tmp_path) == before
    r = run_cli("convert", src, "--out", tmp_path / "fp32")  # its own dtype: nothing to overflow
    assert r.exit_code == 0, r.stderr
    line = assert_clean_failure(run_cli("export", tmp_path / "fp32", "--out", tmp_path / "e16", "--dtype", "fp16"),
                                ["1e+30", "fp16"])
    r = run_cli("export", tmp_path / "fp32", "--out", tmp_path / "bf16", "--dtype", "bf16")  # bf16 holds 1e30
    assert r.exit_code == 0, r.stderr
