"""What a user types wrong: click's usage errors in one `error:` line naming the option (exit 2, gpt2port.usage), and
a mistyped model name, checkpoint name or factory answered with the closest one."""

from __future__ import annotations

import pytest

from tests.support import ROOT, assert_one_line_error, run_cli


@pytest.mark.parametrize("args,named", [
    (["generate", "gpt2", "hi", "--foo"], "'--foo'"),
    (["generate", "gpt2", "hi", "--top-kk", "3"], "'--top-k'"),  # click's suggestion stays on the line
    (["generate"], "'CKPT'"),
    (["generate", "gpt2", "hi", "--temperature", "-1"], "'--temperature'"),
    (["convert", "somewhere"], "'--out'"),
    (["export", "gpt2", "--out", "x", "--to", "hf", "--debug-state"], "--debug-state"),
    (["nonsense"], "'nonsense'"),
    (["--bogus"], "'--bogus'"),
    (["verify", "gpt2", "--tokens", "1"], "'--tokens'"),
])
def test_a_usage_error_is_one_line_naming_the_option(args, named):
    r = run_cli(*args)
    assert r.exit_code == 2, r.output
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], r.stderr
    assert "--help)" in lines[0] and "Usage:" not in r.output


def test_a_mistyped_model_name_gets_the_closest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run_cli("download", "gpt2-mediun")
    assert r.exit_code == 1 and "did you mean 'gpt2-medium'?" in r.stderr and r.stderr.count("\n") == 1
    r = run_cli("info", "gpt2-mediun")
    assert r.exit_code == 1 and "did you mean 'gpt2-medium'?" in r.stderr
    r = run_cli("download", "gpt-j")  # nothing close: no guess
    assert r.exit_code == 1 and "did you mean" not in r.stderr


def test_a_mistyped_checkpoint_under_the_folder_gets_the_closest(tmp_path, monkeypatch, tiny_ckpt):
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_ckpt, tmp_path / "checkpoints" / "shakespeare-tuned")
    r = run_cli("info", "shakespeare-tunned")
    assert r.exit_code == 1 and "did you mean 'shakespeare-tuned'?" in r.stderr


def test_a_mistyped_factory_gets_the_closest(tiny_ckpt):
    r = run_cli("check", f"{ROOT / 'docs' / 'mygpt.py'}:make_modle", tiny_ckpt, "--no-hf")
    line = assert_one_line_error(r.exit_code, r.stderr, r.stdout)  # after check's step lines
    assert "has no function or class 'make_modle'; did you mean 'make_model'?" in line
