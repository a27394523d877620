"""What a newcomer reads: refusals that say what to do instead, results that say what was made, and generate's
account of a busy machine and of a prompt longer than the context."""

from __future__ import annotations

import time

import pytest
import torch

from gpt2port import export
from gpt2port.generate import decode
from tests.support import assert_clean_failure, run_cli


def test_q8_0_for_another_layout_says_where_it_belongs(tiny_ckpt, tmp_path):
    line = assert_clean_failure(run_cli("export", tiny_ckpt, "--out", tmp_path / "hf", "--to", "hf", "--dtype", "q8_0"))
    assert "'q8_0' is for --to gguf only; the hf layout takes fp32, fp16 or bf16" in line
    assert not (tmp_path / "hf").exists()


def test_llmc_names_the_dtype_as_users_type_it(tiny_ckpt, tmp_path):
    line = assert_clean_failure(run_cli("export", tiny_ckpt, "--out", tmp_path / "c", "--to", "llmc",
                                        "--dtype", "fp16"))
    assert "hold fp32 or bf16, not fp16;" in line and "torch." not in line


def test_an_encoded_export_says_its_encoding(tiny_ckpt, tmp_path):
    result = export(tiny_ckpt, tmp_path / "g", to="gguf", dtype="q8_0")
    assert result.dtype == "q8_0"
    assert export(tiny_ckpt, tmp_path / "h", to="hf", dtype="bf16").dtype == torch.bfloat16


def test_generate_on_a_hugging_face_folder_says_convert_first(make_hf_repo):
    repo = make_hf_repo("hub")
    line = assert_clean_failure(run_cli("generate", repo, "Hi", "-n", "1"), names=[repo])
    assert f"run `gpt2port convert {repo} --out DIR` first" in line


def test_short_aliases_are_names_and_documented(tmp_path, monkeypatch, tiny_ckpt):
    from gpt2port.checkpoint import resolve
    from gpt2port.hub.names import resolve_name

    for alias, name in (("small", "gpt2"), ("medium", "gpt2-medium"), ("Large", "gpt2-large"), ("xl", "gpt2-xl")):
        assert resolve_name(alias)[0] == f"openai-community/{name}"
    monkeypatch.setenv("GPT2PORT_CHECKPOINTS", str(tmp_path))
    (tmp_path / "gpt2").symlink_to(tiny_ckpt, target_is_directory=True)
    assert resolve("small") == tmp_path / "gpt2"
    assert "small, medium, large, xl" in run_cli("download", "--help").stdout


def test_a_prompt_longer_than_the_context_echoes_what_the_model_sees(tiny_ckpt):
    from gpt2port import load_tokenizer

    tok = load_tokenizer(tiny_ckpt)
    prompt = "".join(f" w{i}" for i in range(100))  # 200 tokens; the tiny model sees 64
    result = run_cli("generate", tiny_ckpt, prompt, "-n", "2", "-t", "0")
    assert result.exit_code == 0, result.output
    seen = tok.decode(tok.encode(prompt)[-64:])
    assert result.stdout.startswith(seen) and not result.stdout.startswith(prompt[:20])
    assert "note: the prompt has 200 tokens; the model sees only the last 64, and only they are shown" in result.stderr


def test_threads_are_an_argument_and_restored(tiny_ckpt):
    from gpt2port import GPT

    model = GPT.from_pretrained(tiny_ckpt)
    before = torch.get_num_threads()
    during = [torch.get_num_threads() for _ in decode(model, [[1, 2]], 3, temperature=0, threads=1)]
    assert during == [1, 1, 1] and torch.get_num_threads() == before


@pytest.mark.parametrize("busy", [True, False], ids=["busy", "quiet"])
def test_generate_says_when_other_work_slows_decoding(tiny_ckpt, monkeypatch, busy):
    """Decode steps far slower on average than the fastest one: the machine is busy, and --threads is suggested."""
    import gpt2port.generate as decoding

    seen = {}

    def steps(model, ids, n, options, report=None):
        seen["threads"] = options.threads
        for k in range(n):
            time.sleep(0.1 if busy and k % 4 else 0.02)
            yield 11
    monkeypatch.setattr(decoding, "stream", steps)
    result = run_cli("generate", tiny_ckpt, "Hi", "-n", "16", "--threads", "2", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert seen["threads"] == 2 and "(fp32, cpu, 2 threads)" in result.stderr
    hint = "other work on this machine is slowing it down; try --threads 1"
    assert (hint in result.stderr) == busy, result.stderr
