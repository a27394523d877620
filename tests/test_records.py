"""One record for every output (gpt2port/records.py): each file's sha256 taken while its bytes go out, kept in the
output's sealed mark; --force replaces a tree only when every entry still is what gpt2port wrote (ownership.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from gpt2port import records
from gpt2port.errors import GPT2PortError
from gpt2port.fsio import check_replaceable
from tests.support import run_cli, snapshot
from tests.test_force import EARLIER, TINY_FINETUNE, refused
from tests.test_ownership import corpus, run_copy, stopped  # noqa: F401 - fixtures: a real stopped run


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def ours(tmp_path, tiny_ckpt) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, out)  # a copy: every identity moved, so the check reads every file
    return out


def test_every_file_of_a_checkpoint_is_recorded_by_its_content(tiny_ckpt):
    manifest = json.loads((tiny_ckpt / "manifest.json").read_text())
    assert manifest["records"] == "gpt2port-records/1"
    assert set(manifest["files"]) == {p.name for p in tiny_ckpt.iterdir()} - {"manifest.json"}
    for name, rec in manifest["files"].items():
        assert (rec["size"], rec["sha256"]) == ((tiny_ckpt / name).stat().st_size, sha(tiny_ckpt / name)), name
    assert records.files_of(manifest) == manifest["files"]  # sealed
    manifest["dtype"] = "fp16"
    assert records.files_of(manifest) is None  # a mark edited by hand no longer checks out


def _flip(path: Path, at: float = 0.5) -> None:
    """One byte changed in place, the size kept, the modification time set back: only the content says."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(int(st.st_size * at))
        byte = f.read(1)
        f.seek(int(st.st_size * at))
        f.write(bytes([byte[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, indent=2) + "\n")


EDITS = {
    "model.safetensors": lambda d: _flip(d / "model.safetensors", 0.9),  # weights saved in place, same size
    "vocab.json": lambda d: _flip(d / "vocab.json"),
    "merges.txt": lambda d: (d / "merges.txt").write_text((d / "merges.txt").read_text() + "my merge\n"),
    "config.json": lambda d: _edit_json(d / "config.json", note="mine"),
}


@pytest.mark.parametrize("name", list(EDITS))
@pytest.mark.parametrize("in_place", [True, False], ids=["in place", "copied"])
def test_force_refuses_a_checkpoint_whose_files_were_changed(name, in_place, tmp_path, make_hf_repo):
    """Whether the check trusts a file's identity (written in place, untouched since) or reads it (a copy): an
    edited file is refused by name, the tree left as it was."""
    out = tmp_path / "ckpt"
    r = run_cli("convert", make_hf_repo("hub"), "--out", out, "-q")
    assert r.exit_code == 0, r.stderr
    if not in_place:
        shutil.copytree(out, tmp_path / "copy")
        shutil.rmtree(out)
        (tmp_path / "copy").rename(out)
    EDITS[name](out)
    line = refused(["convert", make_hf_repo("hub"), "--out", out, "--force", "-q"], out, names=[out])
    assert f"did not write ({name} (" in line, line
    if name == "model.safetensors":
        assert "same size, other bytes" in line, line


def test_force_replaces_what_checks_out_and_reads_only_what_moved(ours, tiny_ckpt, make_hf_repo, monkeypatch):
    hashed = []
    real = records.hash_file
    monkeypatch.setattr(records, "hash_file", lambda p, *a, **k: hashed.append(Path(p).name) or real(p, *a, **k))
    check_replaceable(tiny_ckpt)  # as written: every identity as recorded, nothing read
    assert hashed == []
    check_replaceable(ours)  # copied: each file read once, its content as recorded
    assert sorted(hashed) == sorted(json.loads((ours / "manifest.json").read_text())["files"])
    r = run_cli("convert", make_hf_repo("hub"), "--out", ours, "--force", "-q", "--dtype", "fp16")
    assert r.exit_code == 0, r.stderr


def test_a_folder_with_a_copied_config_and_no_record_is_refused(tiny_ckpt, tmp_path, make_hf_repo):
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(tiny_ckpt / "config.json", home / "config.json")
    (home / "model.safetensors").write_bytes(b"the user's own weights")
    line = refused(["convert", make_hf_repo("hub"), "--out", home, "--force", "-q"], home, names=[home])
    assert "did not write (config.json, model.safetensors)" in line, line


# --- a run: its log, its tokens ----------------------------------------------------------------------------------

def test_a_run_records_its_log_and_tokens(run_copy):  # noqa: F811
    mark = json.loads((run_copy / records.RUN_RECORD).read_text())
    log = mark["files"]["train_log.jsonl"]
    assert (log["size"], log["sha256"]) == ((run_copy / "train_log.jsonl").stat().st_size,
                                            sha(run_copy / "train_log.jsonl"))
    meta = json.loads((run_copy / "tokens" / "meta.json").read_text())
    for name in ("train.bin", "val.bin"):
        assert meta["files"][name]["sha256"] == sha(run_copy / "tokens" / name)
    check_replaceable(run_copy)


@pytest.mark.parametrize("edit, name", [
    (lambda r: open(r / "train_log.jsonl", "a").write("my notes on this run\n"), "train_log.jsonl"),
    (lambda r: _flip(r / "tokens" / "train.bin"), "tokens/train.bin"),
])
@pytest.mark.parametrize("how", ["--force", "--resume"])
def test_a_runs_changed_log_or_tokens_are_refused(edit, name, how, run_copy, tiny_ckpt, corpus):  # noqa: F811
    edit(run_copy)
    more = TINY_FINETUNE if how == "--force" else ["--quiet"]
    line = refused(["finetune", tiny_ckpt, "--data", corpus, "--out", run_copy, how, *more], run_copy,
                   names=[run_copy])
    assert f"did not write ({name} (" in line, line


def test_a_finished_run_is_checked_without_reading_it(tiny_ckpt, corpus, tmp_path, monkeypatch):  # noqa: F811
    """The fine-tuned checkpoint's files are moved into the run (a rename moves a ctime): their identities are taken
    again, so that --force over the run reads nothing; a copy of it is read, and checks out."""
    run = tmp_path / "run"
    r = run_cli("finetune", tiny_ckpt, "--data", corpus, "--out", run, *TINY_FINETUNE)
    assert r.exit_code == 0, r.stderr
    hashed = []
    real = records.hash_file
    monkeypatch.setattr(records, "hash_file", lambda p, *a, **k: hashed.append(Path(p).name) or real(p, *a, **k))
    check_replaceable(run)
    assert hashed == []
    shutil.copytree(run, tmp_path / "copy")
    check_replaceable(tmp_path / "copy")
    assert "model.safetensors" in hashed


def test_a_log_killed_between_its_record_and_its_line_is_still_the_runs(tmp_path):
    """The record goes one line ahead: a kill before the line, or in the middle of it, leaves a log the record
    describes; a note appended where the line should be is not."""
    rec = records.RunRecord(tmp_path)
    log = tmp_path / "train_log.jsonl"
    f = rec.start_log(log, '{"step": 0}\n')
    f.write('{"step": 1}\n')
    f.close()

    def check():
        return records.changed(log, json.loads((tmp_path / records.RUN_RECORD).read_text())["files"][log.name])
    rec.append('{"step": 1}\n')  # recorded before it is written; it already was
    assert check() is None
    rec.append('{"step": 2, "loss": 1.5}\n')  # recorded, then killed before the line went out
    assert check() is None
    log.write_bytes(log.read_bytes() + b'{"step": 2, "lo')  # killed in the middle of it
    assert check() is None
    log.write_bytes(log.read_bytes()[: -len(b'{"step": 2, "lo')] + b"my note\n")
    assert check() is not None


def test_an_earlier_versions_run_is_refused_by_force_but_resumes(run_copy, tiny_ckpt, corpus):  # noqa: F811
    """A run begun by a version that recorded nothing: --force cannot tell a user's edits and refuses; --resume
    continues it (and the run records its files from then on)."""
    (run_copy / records.RUN_RECORD).unlink()
    meta = json.loads((run_copy / "tokens" / "meta.json").read_text())
    for key in ("records", "files", "seal"):
        meta.pop(key)
    (run_copy / "tokens" / "meta.json").write_text(json.dumps(meta, indent=2))
    line = refused(["finetune", tiny_ckpt, "--data", corpus, "--out", run_copy, "--force", *TINY_FINETUNE],
                   run_copy, names=[run_copy])
    assert EARLIER in line, line
    r = run_cli("finetune", tiny_ckpt, "--data", corpus, "--out", run_copy, "--resume", "--steps", "2", "--quiet")
    assert r.exit_code == 0, r.stderr
    assert (run_copy / records.RUN_RECORD).is_file()


# --- the structure: nothing goes around the record ---------------------------------------------------------------

def test_an_output_written_around_the_record_is_never_put_in_place(tmp_path):
    """A throwaway command whose writer opens a file itself: its output is refused before it is moved into place
    (fsio.staged_directory), so no command can leave a file --force could not tell from a user's."""
    from gpt2port.fsio import staged_directory, write_file, write_mark

    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match=r"written without a record \(notes.bin\)"):
        with staged_directory(out) as stage:
            write_file(stage / "model.gguf", b"through fsio")
            (stage / "notes.bin").write_bytes(b"around it")
            write_mark(stage / "manifest.json", {"tool": "gpt2port", "layout": "gguf"})
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with staged_directory(out) as stage:
        write_file(stage / "model.gguf", b"through fsio")
        write_mark(stage / "manifest.json", {"tool": "gpt2port", "layout": "gguf"})
    check_replaceable(out)


@pytest.mark.parametrize("direct", [True, False])
def test_large_files_are_hashed_as_they_stream_out(tmp_path, monkeypatch, direct):
    from gpt2port import outfile

    monkeypatch.setattr(outfile, "CHUNK", 3 * outfile.BLOCK)
    monkeypatch.setenv("GPT2PORT_DIRECT_IO", "1" if direct else "0")
    data = os.urandom(10 * outfile.BLOCK + 123)
    with records.recording(tmp_path) as rec:
        f = outfile.open_append(tmp_path / "big.bin")
        for i in range(0, len(data), 5000):
            f.write(data[i : i + 5000])
        f.close()
    assert rec.files["big.bin"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert rec.files["big.bin"]["size"] == len(data) == (tmp_path / "big.bin").stat().st_size


def test_an_edited_mark_claims_nothing(ours, make_hf_repo):
    _edit_json(ours / "manifest.json", dtype="bf16")
    before = snapshot(ours)
    with pytest.raises(GPT2PortError, match=r"manifest.json \(changed since gpt2port wrote it\)"):
        check_replaceable(ours)
    assert snapshot(ours) == before
