"""`--force` replaces only what gpt2port wrote, and never a file the run reads, by real path after symlinks; SIGTERM
cleans up as Ctrl-C does; a file under a tokenizer file's name travels into an output only if it is one.

Each case builds the situation a user would be in (weights reached through a symlink into the output, a TensorFlow
`checkpoint` pointer naming it, fine-tuning data inside it, a home folder given as --out) and checks that every
byte under the protected directories survives, and that the refusal is one line naming both sides.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import click
import pytest

from scripts import fake_hub, fill_fake_hub
from tests.support import assert_clean_failure, assert_one_line_error, assert_valid_checkpoint, leftovers, run_cli, \
    snapshot
from tests.support import FIXTURES

FOREIGN = "holds files gpt2port did not write (.ssh, notes.txt); choose another --out or remove it yourself"
TINY_FINETUNE = ["--steps", "1", "--batch-size", "2", "--block-size", "16", "--eval-every", "0", "--quiet"]


def refused(args, *protected: Path, names=()) -> str:
    """Run the CLI expecting a clean one-line refusal that leaves every protected tree as it was."""
    before = {p: snapshot(p) for p in protected}
    line = assert_clean_failure(run_cli(*args), names)
    for p in protected:
        assert snapshot(p) == before[p], f"{p} changed"
        assert leftovers(p.parent) == []
    return line


@pytest.fixture
def ours(tmp_path, tiny_ckpt) -> Path:
    """A checkpoint gpt2port wrote, in a place the user may pass as --out --force."""
    store = tmp_path / "store"
    shutil.copytree(tiny_ckpt, store)
    return store


@pytest.fixture
def home(tmp_path) -> Path:
    """A folder that is not gpt2port's: a key and some notes."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nsecret\n")
    (home / "notes.txt").write_text("things to remember\n")
    return home


@pytest.fixture
def corpus(tmp_path) -> Path:
    text = tmp_path / "corpus.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    return text


# --- 1. what the run reads, by real path ---------------------------------------------------------------------------

@pytest.mark.parametrize("given", ["directory", "weights file"])
def test_weights_reached_through_a_symlink_survive_force(given, ours, tmp_path):
    """links/model.safetensors -> store/model.safetensors: `convert links --out store --force` would delete the very
    file it converts (the names differ, the real paths do not)."""
    links = tmp_path / "links"
    links.mkdir()
    for name in ("model.safetensors", "config.json"):
        (links / name).symlink_to(ours / name)
    src = links if given == "directory" else links / "model.safetensors"
    line = refused(["convert", src, "--out", ours, "--force", "-q"], ours, links, names=[ours])
    assert str(ours / "model.safetensors") in line and "reads" in line


def test_shards_reached_through_symlinks_survive_force(make_hf_repo, tmp_path):
    sharded = make_hf_repo("sharded")
    store, links = tmp_path / "store", tmp_path / "links"
    store.mkdir()
    links.mkdir()
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    for f in sharded.iterdir():
        if f in shards:
            shutil.copy(f, store / f.name)
            (links / f.name).symlink_to(store / f.name)
        else:
            shutil.copy(f, links / f.name)
    line = refused(["convert", links, "--out", store, "--force", "-q"], store, links, names=[store])
    assert "model-0000" in line and "reads" in line


def test_a_tensorflow_checkpoint_pointer_naming_the_output_survives_force(tmp_path):
    """OpenAI's layout: a `checkpoint` file names the prefix, which may be in another directory: that directory is
    what the run reads."""
    store = tmp_path / "store"
    shutil.copytree(FIXTURES / "tf" / "tiny", store)
    pointer = tmp_path / "pointer"
    pointer.mkdir()
    (pointer / "checkpoint").write_text(f'model_checkpoint_path: "{store / "model.ckpt"}"\n')
    line = refused(["convert", pointer, "--out", store, "--force", "-q"], store, pointer, names=[store])
    assert "model.ckpt" in line and "reads" in line


@pytest.mark.parametrize("where", ["data is --out", "data inside --out"])
def test_finetune_force_never_removes_its_data(where, tiny_ckpt, tmp_path):
    run = tmp_path / "run"
    (run / "corpus").mkdir(parents=True)
    text = run / "corpus" / "a.txt"
    text.write_text("Fine-tuning text that must survive. " * 40)
    data = run if where == "data is --out" else text
    line = refused(["finetune", tiny_ckpt, "--data", data, "--out", run, "--force", *TINY_FINETUNE], run,
                   names=[run])
    assert "reads" in line


# --- 3. only what gpt2port wrote -----------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["convert", "export-gpt2port", "export-hf", "export-llmc", "export-gguf",
                                     "finetune"])
def test_force_refuses_a_folder_gpt2port_did_not_write(command, home, make_hf_repo, tiny_ckpt, corpus):
    args = {"convert": ["convert", make_hf_repo("hub"), "-q"],
            "finetune": ["finetune", tiny_ckpt, "--data", corpus, *TINY_FINETUNE]}.get(command)
    if args is None:
        args = ["export", tiny_ckpt, "--to", command.removeprefix("export-")]
    line = refused([*args, "--out", home, "--force"], home, names=[home])
    assert line.endswith(FOREIGN), line


def test_download_force_refuses_a_folder_gpt2port_did_not_write(home, tmp_path, tiny_hf_model):
    root = tmp_path / "hub-root"
    fill_fake_hub.write_hub_repo(root, "someone/tiny-gpt2", tiny_hf_model)
    before = snapshot(home)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    with fake_hub.FakeHub(root) as hub:
        env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_XET="1",
                   HF_HUB_DISABLE_TELEMETRY="1")
        r = subprocess.run([sys.executable, "-m", "gpt2port", "download", "someone/tiny-gpt2", "--out", str(home),
                            "--force", "-q"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    line = assert_one_line_error(r.returncode, r.stderr, r.stdout, names=[home])
    assert line.endswith(FOREIGN), line
    assert snapshot(home) == before


def test_force_refuses_a_checkpoint_the_user_added_a_file_to(ours, make_hf_repo):
    (ours / "notes.txt").write_text("mine\n")
    line = refused(["convert", make_hf_repo("hub"), "--out", ours, "--force", "-q"], ours, names=[ours])
    assert "did not write (notes.txt)" in line


def test_force_refuses_a_look_alike_without_gpt2ports_mark(tmp_path, make_hf_repo):
    """A Hugging Face directory of the user's: every name is one gpt2port also writes, but nothing says it did."""
    theirs = tmp_path / "theirs"
    shutil.copytree(make_hf_repo("save_pretrained"), theirs)
    line = refused(["convert", make_hf_repo("hub"), "--out", theirs, "--force", "-q"], theirs, names=[theirs])
    assert "config.json" in line and "did not write" in line


EARLIER = "written by an earlier version of gpt2port, which kept no fingerprint of the files it wrote"


def test_a_previous_versions_checkpoint_is_refused_by_force_and_still_loads(tmp_path, make_hf_repo):
    """A version that recorded no fingerprints leaves nothing to tell its files from a user's edits of them:
    --force refuses it in a line of its own; it loads as ever."""
    old = tmp_path / "old"
    shutil.copytree(FIXTURES / "v1-checkpoint", old)
    line = refused(["convert", make_hf_repo("hub"), "--out", old, "--force", "-q", "--dtype", "fp16"], old,
                   names=[old])
    assert EARLIER in line, line
    assert_valid_checkpoint(old)


@pytest.mark.parametrize("to", ["hf", "llmc", "gguf"])
def test_exports_carry_gpt2ports_mark_and_older_ones_are_refused(to, tiny_ckpt, tmp_path):
    """Older hf and GGUF exports carry marks of gpt2port's own, but no fingerprints: refused as an earlier version's;
    llm.c's files are the same bytes whoever wrote them (llm.c's train_gpt2.py, or gpt2port before exports had a
    manifest), so a directory of them is refused as the user's."""
    out = tmp_path / "export"
    r = run_cli("export", tiny_ckpt, "--out", out, "--to", to)
    assert r.exit_code == 0, r.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tool"] == "gpt2port" and manifest["layout"] == to
    assert set(manifest["files"]) == {p.name for p in out.iterdir()} - {"manifest.json"}
    r = run_cli("export", tiny_ckpt, "--out", out, "--to", to, "--force")  # its own export is replaced
    assert r.exit_code == 0, r.stderr
    (out / "manifest.json").unlink()  # as the version before manifests wrote it
    before = snapshot(out)
    r = run_cli("export", tiny_ckpt, "--out", out, "--to", to, "--force")
    line = assert_one_line_error(r.exit_code, r.stderr, r.stdout)
    assert snapshot(out) == before
    if to == "llmc":
        assert f"{out}: holds files gpt2port did not write (gpt2_" in line, line
    else:
        assert EARLIER in line, line
    assert leftovers(tmp_path) == []


def test_a_finished_run_is_replaced_by_force(tiny_ckpt, corpus, tmp_path):
    run = tmp_path / "run"
    for _ in range(2):
        r = run_cli("finetune", tiny_ckpt, "--data", corpus, "--out", run, "--force", *TINY_FINETUNE)
        assert r.exit_code == 0, r.stderr
    expected = {"model.safetensors", "config.json", "manifest.json", "train_log.jsonl"}
    assert expected <= {p.name for p in run.iterdir()}


@pytest.mark.parametrize("kind, ours", [("tags only", False), ("killed while tokenizing", True),
                                        ("unmarked build directory", False), ("look-alike", False), ("empty", True)])
def test_what_a_run_leaves_behind_is_recognised(kind, ours, tmp_path):
    """A fine-tuning run stopped before it became a checkpoint has no manifest: its meta.json files say whose it is,
    and count only when the files they describe check out (tests/test_ownership.py has real stopped runs); a build
    directory is a killed run's only when it carries the stage mark naming it."""
    from gpt2port.errors import GPT2PortError
    from gpt2port.fsio import STAGE_MARK, check_replaceable

    run = tmp_path / "run"
    run.mkdir()
    if kind == "tags only":
        for sub, tag in (("tokens", "gpt2port-tokens/1"), ("train_state", "gpt2port-train-state/1")):
            (run / sub).mkdir()
            (run / sub / "meta.json").write_text(json.dumps({"format": tag}))
        (run / "train_log.jsonl").write_text("{}\n")
    elif kind in ("killed while tokenizing", "unmarked build directory"):
        (run / ".tokens.partial-4194305").mkdir()
        (run / ".tokens.partial-4194305" / "train.bin").write_bytes(b"\0" * 8)
        if kind == "killed while tokenizing":
            (run / ".tokens.partial-4194305" / STAGE_MARK).write_text(
                json.dumps({"tool": "gpt2port", "stage": ".tokens.partial-4194305"}))
    elif kind == "look-alike":
        (run / "tokens").mkdir()
        (run / "tokens" / "meta.json").write_text(json.dumps({"format": "someone-else/1"}))
        (run / "train_log.jsonl").write_text("{}\n")
    if ours:
        check_replaceable(run)
    else:
        # a state marked as ours but incomplete is named by the file at fault
        names = {"tags only": "tokens, train_log.jsonl, train_state/meta.json (its world, null, is not a count of "
                              "the ranks it saved)",
                 "look-alike": "tokens, train_log.jsonl", "unmarked build directory": ".tokens.partial-4194305"}[kind]
        with pytest.raises(GPT2PortError, match=re.escape(f"did not write ({names})")):
            check_replaceable(run)


# --- 12. side files ------------------------------------------------------------------------------------------------

def test_a_tokenizer_name_linked_to_a_private_file_is_not_carried(tmp_path, make_hf_repo):
    src = tmp_path / "src"
    shutil.copytree(make_hf_repo("hub"), src)
    secret = tmp_path / "id_rsa"
    secret.write_bytes(b"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n")
    (src / "vocab.json").unlink()
    (src / "vocab.json").symlink_to(secret)
    out = tmp_path / "out"
    r = run_cli("convert", src, "--out", out, "-q")
    assert r.exit_code == 0, r.stderr
    assert not (out / "vocab.json").exists()
    assert all(b"PRIVATE KEY" not in p.read_bytes() for p in out.iterdir())
    warning = next(line for line in r.stderr.splitlines() if str(src / "vocab.json") in line)
    assert warning.startswith("warning: ") and str(secret) in warning and "not a GPT-2 tokenizer file" in warning


# --- 10. signals ---------------------------------------------------------------------------------------------------

def _default_signals() -> None:
    """In the child: SIGINT and SIGTERM as a terminal gives them, whatever this test runner was started with."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.mark.parametrize("prev", ["absent", "existing"])
def test_sigterm_mid_conversion_cleans_up_like_ctrl_c(prev, make_hf_repo, dest_for, tmp_path):
    from tests.test_faults import FAULTS, wait_for

    src, dest = make_hf_repo("hub"), dest_for(prev)
    before_src, before_dest = snapshot(src), snapshot(dest)
    started = tmp_path / "started"
    env = {**os.environ, "GPT2PORT_TEST_FAULT": json.dumps({"slow": 0.05, "started": str(started)})}
    proc = subprocess.Popen([sys.executable, "-c", FAULTS, "convert", str(src), "--out", str(dest), "-q",
                             *(["--force"] if prev == "existing" else [])], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_default_signals)
    wait_for(started, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err)
    assert_one_line_error(proc.returncode, err, out, names=["terminated"])
    assert leftovers(dest.parent) == []
    assert snapshot(dest) == before_dest and snapshot(src) == before_src


def test_ctrl_c_while_the_success_line_prints_exits_0(make_hf_repo, tmp_path, monkeypatch):
    """The work is done once the success line is being printed: a Ctrl-C then must not report a failure."""
    echo = click.echo

    def interrupted_echo(message=None, *args, **kwargs):
        echo(message, *args, **kwargs)
        if str(message).startswith("wrote "):
            raise KeyboardInterrupt

    monkeypatch.setattr(click, "echo", interrupted_echo)
    out = tmp_path / "out"
    r = run_cli("convert", make_hf_repo("hub"), "--out", out, "-q")
    assert r.exit_code == 0, r.output
    assert_valid_checkpoint(out)


@pytest.fixture
def gguf_file(tiny_ckpt, tmp_path) -> Path:
    r = run_cli("export", tiny_ckpt, "--to", "gguf", "--out", tmp_path / "g")
    assert r.exit_code == 0, r.stderr
    return tmp_path / "g" / "model.gguf"


def test_sigkill_converting_a_gguf_leaves_nothing_outside_the_output(gguf_file, tmp_path):
    """The tokenizer a GGUF embeds is rebuilt as files; after a SIGKILL nothing of them may be left in $TMPDIR,
    only the build directory beside --out, which the next run sweeps."""
    from gpt2port.fsio import PARTIAL_MARK
    from tests.test_faults import FAULTS, wait_for

    scratch, dest, started = tmp_path / "tmpdir", tmp_path / "out" / "ckpt", tmp_path / "started"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch),
           "GPT2PORT_TEST_FAULT": json.dumps({"slow": 0.05, "started": str(started)})}
    proc = subprocess.Popen([sys.executable, "-c", FAULTS, "convert", str(gguf_file), "--out", str(dest), "-q"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_default_signals)
    wait_for(started, proc)
    proc.kill()
    proc.communicate(timeout=60)
    assert [p.name for p in scratch.iterdir() if "gpt2port" in p.name] == []
    assert leftovers(dest.parent) == [f".{dest.name}{PARTIAL_MARK}{proc.pid}"]
    r = run_cli("convert", gguf_file, "--out", dest, "-q")
    assert r.exit_code == 0, r.stderr
    assert leftovers(dest.parent) == [] and {"vocab.json", "merges.txt"} <= {p.name for p in dest.iterdir()}
    assert_valid_checkpoint(dest)


def test_a_ggufs_tokenizer_is_rebuilt_inside_the_output_being_built(gguf_file, tmp_path, monkeypatch):
    import gpt2port.sources as sources_mod

    made = []
    write = sources_mod.write_bpe_files
    monkeypatch.setattr(sources_mod, "write_bpe_files", lambda d, *a: made.append(Path(d)) or write(d, *a))
    dest = tmp_path / "out"
    r = run_cli("convert", gguf_file, "--out", dest, "-q")
    assert r.exit_code == 0, r.stderr
    assert len(made) == 1 and made[0].parent.name.startswith(".out.partial-") and not made[0].parent.exists()
    assert not [p for p in dest.iterdir() if p.name.startswith(".")]
