"""`--force` and every sweep decide on the whole tree they would remove (gpt2port/ownership.py): every entry at
every depth is something a gpt2port writer makes, of the kind it makes, under a mark that checks out against what
it describes. Each case puts a user's file where the previous rule looked only at names or believed a mark, and
checks that the refusal is one line naming it and that every byte survives.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpt2port.fsio import STAGE_MARK
from tests.support import assert_one_line_error, assert_valid_checkpoint, leftovers, run_cli, snapshot
from tests.test_force import TINY_FINETUNE, refused


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    text = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    return text


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, tiny_ckpt, corpus) -> Path:
    """What a fine-tuning run stopped at step 1 leaves: tokens/, train_state/, train_log.jsonl (made by training
    for real, its state kept)."""
    from gpt2port.training import state
    from gpt2port.training.finetune import Settings, finetune

    run = tmp_path_factory.mktemp("runs") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(state, "remove", lambda out: None)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            finetune(tiny_ckpt, corpus, run, Settings(steps=2, batch_size=2, block_size=16, eval_every=0,
                                                      save_every=1), quiet=True)
        finally:
            torch.set_num_threads(threads)
    out = run.parent / "stopped"
    out.mkdir()
    for name in ("tokens", "train_state", "train_log.jsonl", "train_log.record.json"):
        (shutil.copytree if (run / name).is_dir() else shutil.copy)(run / name, out / name)
    return out


@pytest.fixture
def run_copy(stopped, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    return out


def force_args(command: str, out: Path, make_hf_repo, tiny_ckpt, corpus) -> list:
    return {"convert": ["convert", make_hf_repo("hub"), "-q"],
            "export-gguf": ["export", tiny_ckpt, "--to", "gguf"],
            "finetune": ["finetune", tiny_ckpt, "--data", corpus, *TINY_FINETUNE]}[command] + ["--out", out, "--force"]


# --- 1. the whole tree, every depth ----------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["tokens", "train_state", ".checkpoint"])
@pytest.mark.parametrize("command", ["convert", "export-gguf", "finetune"])
def test_a_users_file_inside_a_runs_folders_survives_force(command, where, run_copy, make_hf_repo, tiny_ckpt,
                                                           corpus):
    (run_copy / where).mkdir(exist_ok=True)
    (run_copy / where / "notes.txt").write_text("mine\n")
    line = refused(force_args(command, run_copy, make_hf_repo, tiny_ckpt, corpus), run_copy, names=[run_copy])
    assert f"did not write ({where}/notes.txt)" in line, line


@pytest.mark.parametrize("name", ["vocab.json", "model.safetensors", "manifest.json"])
def test_a_users_directory_under_a_name_gpt2port_writes_as_a_file_survives_force(name, tiny_ckpt, make_hf_repo,
                                                                                 tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, out)
    (out / name).unlink()
    (out / name).mkdir()
    (out / name / "thesis.tex").write_text("chapter 1\n")
    line = refused(["convert", make_hf_repo("hub"), "--out", out, "--force", "-q"], out, names=[out])
    assert f"{name} (a directory, where gpt2port writes a file)" in line, line


def test_a_folder_holding_only_a_users_partial_lookalike_is_not_leftovers(make_hf_repo, tmp_path):
    home = tmp_path / "home"
    (home / ".thesis.partial-1").mkdir(parents=True)
    (home / ".thesis.partial-1" / "chapter1.tex").write_text("chapter 1\n")
    line = refused(["convert", make_hf_repo("hub"), "--out", home, "--force", "-q"], home, names=[home])
    assert "did not write (.thesis.partial-1)" in line, line


def test_a_run_and_a_checkpoint_of_ours_are_still_replaced(run_copy, make_hf_repo, tiny_ckpt, tmp_path):
    """The rule refuses what is not ours, and only that: a stopped run (tokens/ and train_state/ checked against
    their meta.json) and a checkpoint (weights against manifest.json) are replaced, with their leftovers."""
    stage = run_copy / f".tokens.partial-{2 ** 22 + 1}"  # a run killed while tokenizing
    stage.mkdir()
    (stage / STAGE_MARK).write_text(json.dumps({"tool": "gpt2port", "stage": stage.name}))
    (stage / "train.bin").write_bytes(b"\0" * 10)
    r = run_cli("convert", make_hf_repo("hub"), "--out", run_copy, "--force", "-q")
    assert r.exit_code == 0, r.stderr
    assert_valid_checkpoint(run_copy)
    r = run_cli("export", tiny_ckpt, "--to", "gguf", "--out", run_copy, "--force")
    assert r.exit_code == 0, r.stderr
    assert sorted(p.name for p in run_copy.iterdir()) == ["manifest.json", "model.gguf"]
    assert leftovers(tmp_path) == []


# --- 2. marks checked against what they describe ---------------------------------------------------------------------

def test_a_forged_tokens_mark_does_not_make_a_users_folder_replaceable(make_hf_repo, tmp_path):
    home = tmp_path / "home"
    (home / "tokens").mkdir(parents=True)
    (home / "tokens" / "meta.json").write_text(json.dumps({"format": "gpt2port-tokens/1"}))
    (home / "config.json").write_text(json.dumps({"my": "settings"}))
    (home / "corpus.txt").write_text("years of notes\n")
    line = refused(["convert", make_hf_repo("hub"), "--out", home, "--force", "-q"], home, names=[home])
    assert "did not write (config.json, corpus.txt, tokens)" in line, line


@pytest.mark.parametrize("forged, name", [({"tool": "gpt2port"}, "merges.txt"),
                                          ({"tool": "gpt2port", "layout": "llmc", "files": {"vocab.json": 11}},
                                           "vocab.json")])
def test_a_forged_manifest_claims_nothing_gpt2port_did_not_write(forged, name, make_hf_repo, tmp_path):
    """A manifest claims only what it lists under its layout's own names: not a tokenizer file it does not list, not
    a name llm.c's export never writes."""
    home = tmp_path / "home"
    home.mkdir()
    (home / name).write_text("my notes\n\n")
    (home / "manifest.json").write_text(json.dumps(forged))
    line = refused(["convert", make_hf_repo("hub"), "--out", home, "--force", "-q"], home, names=[home])
    assert f"did not write (manifest.json, {name})" in line, line


def test_weights_swapped_into_a_checkpoint_are_not_replaced(tiny_ckpt, make_hf_repo, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, out)
    recorded = json.loads((out / "manifest.json").read_text())["files"]["model.safetensors"]["size"]
    (out / "model.safetensors").write_bytes(b"the user's own weights, of another size")
    line = refused(["convert", make_hf_repo("hub"), "--out", out, "--force", "-q"], out, names=[out])
    assert f"model.safetensors (39 bytes; gpt2port wrote {recorded:,})" in line, line


def test_resume_into_a_folder_holding_a_copied_train_state_keeps_the_users_config(stopped, tiny_ckpt, corpus,
                                                                                  tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.json").write_text(json.dumps({"learning_rate": 3e-4, "mine": True}))
    shutil.copytree(stopped / "train_state", home / "train_state")
    line = refused(["finetune", tiny_ckpt, "--data", corpus, "--out", home, "--resume", *TINY_FINETUNE[4:]], home,
                   names=[home])
    assert "did not write (config.json)" in line, line


# --- 3. sweeps of build directories ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dest_exists", [False, True])
def test_a_users_lookalike_build_directories_beside_out_are_not_swept(dest_exists, tiny_ckpt, make_hf_repo,
                                                                       tmp_path):
    dest = tmp_path / "out"
    if dest_exists:
        shutil.copytree(tiny_ckpt, dest)
    theirs = [tmp_path / ".out.partial-999999", tmp_path / ".out.replaced-999999"]
    for d in theirs:
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"my own weights")
    before = {d: snapshot(d) for d in theirs}
    r = run_cli("convert", make_hf_repo("hub"), "--out", dest, "--force", "-q")
    assert r.exit_code == 0, r.stderr
    assert_valid_checkpoint(dest)
    assert {d: snapshot(d) for d in theirs} == before


def test_a_marked_build_directory_of_a_finished_process_is_swept(make_hf_repo, tmp_path):
    stage = tmp_path / ".out.partial-999999"
    stage.mkdir()
    (stage / STAGE_MARK).write_text(json.dumps({"tool": "gpt2port", "stage": stage.name}))
    (stage / "model.safetensors").write_bytes(b"half written")
    r = run_cli("convert", make_hf_repo("hub"), "--out", tmp_path / "out", "-q")
    assert r.exit_code == 0, r.stderr
    assert leftovers(tmp_path) == []


# --- 5. nothing opened that can block --------------------------------------------------------------------------------

def cli(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    """In a process of its own, with a time limit: a command that would block for ever fails the test instead."""
    return subprocess.run([sys.executable, "-m", "gpt2port", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def test_a_fifo_in_out_is_refused_by_type_not_opened(tiny_ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "model.gguf")
    r = cli("export", tiny_ckpt, "--to", "gguf", "--out", out, "--force", timeout=60)
    line = assert_one_line_error(r.returncode, r.stderr, r.stdout, names=[out])
    assert "model.gguf (a FIFO, where gpt2port writes a file)" in line, line
    assert (out / "model.gguf").is_fifo()


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_fifo_among_the_inputs_is_refused_by_type(name, make_hf_repo, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(make_hf_repo("hub"), src)
    (src / name).unlink()
    os.mkfifo(src / name)
    r = cli("convert", src, "--out", tmp_path / "out", "-q", timeout=60)
    line = assert_one_line_error(r.returncode, r.stderr, r.stdout, names=[src / name])
    assert "FIFO" in line and "empty" not in line, line


def test_out_as_a_fifo_says_what_it_is(make_hf_repo, tmp_path):
    out = tmp_path / "out"
    os.mkfifo(out)
    r = cli("convert", make_hf_repo("hub"), "--out", out, "-q", timeout=60)
    line = assert_one_line_error(r.returncode, r.stderr, r.stdout, names=[out])
    assert "FIFO" in line, line


# --- 8. one line naming the path -------------------------------------------------------------------------------------

def test_finetune_force_through_a_symlinked_out_names_it(stopped, tiny_ckpt, corpus, tmp_path):
    real = tmp_path / "real"
    shutil.copytree(stopped, real)
    link = tmp_path / "link"
    link.symlink_to(real)
    line = refused(["finetune", tiny_ckpt, "--data", corpus, "--out", link, "--force", *TINY_FINETUNE], real,
                   names=[link])
    assert "symbolic link" in line and "rmtree" not in line, line


def test_resume_with_tokens_a_symlink_names_it(stopped, tiny_ckpt, corpus, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    elsewhere = tmp_path / "elsewhere"
    (run / "tokens").rename(elsewhere)
    (run / "tokens").symlink_to(elsewhere)
    line = refused(["finetune", tiny_ckpt, "--data", corpus, "--out", run, "--resume", *TINY_FINETUNE[4:]], run,
                   elsewhere, names=[run])
    assert "tokens (a symbolic link)" in line and "rmtree" not in line, line


def test_out_nested_2000_directories_deep(make_hf_repo, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative, so that the path fits in PATH_MAX: the depth is what is tested
    out = Path(*["d"] * 2000)
    try:
        r = run_cli("convert", make_hf_repo("hub"), "--out", out, "-q")
        if r.exit_code == 0:
            assert_valid_checkpoint(out)
        else:
            line = assert_one_line_error(r.exit_code, r.stderr, r.stdout)
            assert "RecursionError" not in line and "internal error" not in line and "d/d/d" in line, line
    finally:
        subprocess.run(["rm", "-rf", "d"], check=True)  # shutil.rmtree recurses once per level


# --- one place per fact: a target's files are its REGISTRY row's ----------------------------------------------------

def write(job) -> int:
    """The writer of the throwaway target below: every tensor's bytes, one after another, in toy.bin."""
    from gpt2port.fsio import write_file

    with job.staged() as stage:
        write_file(stage / "toy.bin", b"".join(produce().to(dtype).contiguous().view(-1).view(torch.uint8).numpy()
                                               .tobytes() for _, dtype, _, produce in job.items))
        job.write_manifest(stage, "toy")
        return (stage / "toy.bin").stat().st_size


def test_a_new_target_is_one_registry_row_and_force_follows_it(tiny_ckpt, tmp_path, monkeypatch):
    """Registered in targets.REGISTRY only (its writer is this module's write): exported, replaced with --force, and
    refused over a user's file; fsio/ownership learn its file names from the row."""
    from gpt2port import targets
    from gpt2port.conversion import export
    from gpt2port.errors import GPT2PortError

    monkeypatch.setitem(targets.REGISTRY, "toy", targets.Target("toy", __name__, targets.FLOATS, layout="gpt2port",
                                                                files=("toy.bin", "manifest.json")))
    out = tmp_path / "toy"
    export(tiny_ckpt, out, to="toy")
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "toy.bin"]
    export(tiny_ckpt, out, to="toy", dtype="fp16", force=True)
    assert json.loads((out / "manifest.json").read_text())["dtype"] == "fp16"
    (out / "notes.txt").write_text("mine\n")
    before = snapshot(out)
    with pytest.raises(GPT2PortError, match=r"did not write \(notes.txt\)"):
        export(tiny_ckpt, out, to="toy", force=True)
    assert snapshot(out) == before
    (out / "notes.txt").unlink()
    (out / "toy.bin").write_bytes(b"swapped")  # no longer the size its manifest records
    with pytest.raises(GPT2PortError, match=r"toy.bin \(7 bytes; gpt2port wrote"):
        export(tiny_ckpt, out, to="toy", force=True)


def test_finetune_into_a_link_to_an_empty_directory_names_it(tiny_ckpt, corpus, tmp_path):
    real = tmp_path / "big-disk" / "run"
    real.mkdir(parents=True)
    link = tmp_path / "run"
    link.symlink_to(real)
    line = refused(["finetune", tiny_ckpt, "--data", corpus, "--out", link, *TINY_FINETUNE], real, names=[link])
    assert "symbolic link" in line and "rmtree" not in line, line
