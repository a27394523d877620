"""`gpt2port download` end to end: a real huggingface_hub client, over real HTTP on loopback, against the stand-in
Hub (scripts/fake_hub.py) serving random-weight repos in the real layouts (scripts/fill_fake_hub.py).

huggingface_hub reads HF_ENDPOINT / HF_HUB_OFFLINE / HF_HOME at import, so every download runs in a subprocess
(`python -m gpt2port download ...`) with its own environment and its own HF_HOME; the server runs in this process,
so the tests can read its request log and switch its faults.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from scripts import fake_hub, fill_fake_hub, hf_fixtures
from gpt2port.errors import GPT2PortError
from tests.support import interruptible
from tests.support import ROOT

TINY_REPO = "gpt2port-fixtures/tiny"
BIN_REPO = "gpt2port-fixtures/tiny-bin-only"
SHARDED_REPO = "gpt2port-fixtures/tiny-sharded"
BROKEN_REPO = "gpt2port-fixtures/tiny-shard-missing"
NEEDED = {"config.json", "vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "model.safetensors"}
NEVER = set(fill_fake_hub.DECOYS) | {"README.md", ".gitattributes", "generation_config.json"}


# --- fixtures ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def hub_models(tiny_hf_model):
    """The HF models behind the fixture repos: revision main is seed 0, revision v1 is seed 1 (fill_fake_hub)."""
    return {"main": tiny_hf_model, "v1": hf_fixtures.make_hf_model(hf_fixtures.hf_config(hf_fixtures.TINY), seed=1)}


@pytest.fixture(scope="session")
def hub_root(tmp_path_factory, hub_models):
    root = tmp_path_factory.mktemp("fake-hub-root")
    fill_fake_hub.fill(root, ["tiny"], log=lambda s: None)
    fill_fake_hub.write_hub_repo(root, "openai-community/gpt2", hub_models["main"], decoys=True)
    broken = fill_fake_hub.write_hub_repo(root, BROKEN_REPO, hub_models["main"], layout="sharded")
    (broken / "model-00002-of-00002.safetensors").unlink()
    return root


@pytest.fixture(scope="session")
def session_hub(hub_root):
    with fake_hub.FakeHub(hub_root) as hub:
        yield hub


@pytest.fixture
def hub(session_hub):
    session_hub.reset()
    yield session_hub
    session_hub.reset()


def _env(hub_url: str, home: Path, offline: bool = False, **extra) -> dict:
    # Drop the caller's HF settings (the test session runs with HF_HUB_OFFLINE=1) and point at the stand-in.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE", "TRANSFORMERS_OFFLINE"))}
    env.update(HF_ENDPOINT=hub_url, HF_HUB_DISABLE_XET="1", HF_HOME=str(home / "hf"),
               GPT2PORT_CHECKPOINTS=str(home / "checkpoints"), HF_HUB_DISABLE_TELEMETRY="1")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    env.update(extra)
    return env


def download(hub_url: str, home: Path, *args, offline: bool = False, timeout: float = 120, **env):
    """`gpt2port download ARGS` in a fresh process with its own environment; returns returncode/stdout/stderr.

    The process is forked from a server that has imported torch and gpt2port but never huggingface_hub (a plain
    `python -m gpt2port` spends most of its time importing torch): the child sets its environment first, so
    huggingface_hub reads HF_ENDPOINT / HF_HOME / HF_HUB_OFFLINE at import exactly as in a fresh interpreter.
    """
    n = next(_runs)
    out, err = home / f".download-{n}.out", home / f".download-{n}.err"
    proc = _forkserver().Process(target=_cli_in_child, args=(["download", *args], _env(hub_url, home, offline, **env),
                                                             str(home), str(out), str(err)))
    proc.start()
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        pytest.fail(f"gpt2port download {' '.join(args)} did not finish in {timeout}s")
    return SimpleNamespace(returncode=proc.exitcode, stdout=out.read_text(), stderr=err.read_text())


_runs = itertools.count()
_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["torch", "gpt2port.cli", "gpt2port.conversion", "gpt2port.hub"])
    return _context


def _cli_in_child(argv, env, cwd, out_path, err_path):
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    assert "huggingface_hub" not in sys.modules  # or it would have read the server's environment
    from gpt2port.cli import main

    try:
        main(argv, prog_name="gpt2port")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def assert_logits_match(ckpt: Path, hf_model, dtype=None) -> None:
    from gpt2port import GPT

    model = GPT.from_pretrained(ckpt, dtype=dtype)
    idx = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, _ = model(idx)
        ref = hf_model(idx).logits
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def one_error_line(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode != 0, r.stdout + r.stderr
    assert len(lines) == 1, r.stderr
    return lines[0]


def cache_dir(home: Path, repo: str) -> Path:
    return home / "hf" / "hub" / ("models--" + repo.replace("/", "--"))


def commit_of(hub, repo: str, revision: str = "main") -> str:
    return hub.store.resolve(repo, revision)[0]


def sha256_of(hub, repo: str, name: str, revision: str = "main") -> str:
    commit, rev_dir = hub.store.resolve(repo, revision)
    return hub.store.file(rev_dir, name, commit).sha256


def leftovers(path: Path) -> list[Path]:
    return [p for p in path.parent.glob(f".{path.name}*")] if path.parent.exists() else []


# --- the main path -------------------------------------------------------------------------------------------------

def test_download_name_converts_exactly_the_needed_files(hub, tmp_path, hub_models):
    r = download(hub.url, tmp_path, "gpt2")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "checkpoints" / "gpt2"
    assert_logits_match(out, hub_models["main"])
    # Only what conversion needs crossed the wire: no decoys, no README, not even a HEAD on them.
    assert hub.requested_files() == NEEDED
    assert sorted(hub.file_gets()) == sorted(NEEDED)
    assert not (hub.requested_files() & NEVER)
    # Provenance pins the commit and records the verified hashes; source = the cache snapshot.
    manifest = json.loads((out / "manifest.json").read_text())
    src = manifest["source"]
    commit = commit_of(hub, "openai-community/gpt2")
    assert (src["repo"], src["revision"], src["commit"]) == ("openai-community/gpt2", "main", commit)
    assert Path(src["path"]) == cache_dir(tmp_path, "openai-community/gpt2") / "snapshots" / commit
    hashes = {f["name"]: f["sha256"] for f in src["files"]}
    assert hashes["model.safetensors"] == sha256_of(hub, "openai-community/gpt2", "model.safetensors")
    assert hashes["vocab.json"] == "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
    # The cache ref lets later offline runs resolve "main".
    assert (cache_dir(tmp_path, "openai-community/gpt2") / "refs" / "main").read_text() == commit
    assert "converted" in r.stdout and "1,635,744 parameters" in r.stdout


def test_second_download_transfers_nothing(hub, tmp_path, hub_models):
    assert download(hub.url, tmp_path, TINY_REPO, "--out", "a").returncode == 0
    hub.reset()
    r = download(hub.url, tmp_path, TINY_REPO, "--out", "b")
    assert r.returncode == 0, r.stderr
    assert hub.file_gets() == [] and hub.requested_files() == set()  # no GET, not even a HEAD, on any file
    assert all(e["kind"] == "api" for e in hub.entries())
    assert "nothing: all 6 files were in the Hugging Face cache" in r.stdout
    assert_logits_match(tmp_path / "b", hub_models["main"])
    # The same checkpoint again: already up to date, nothing fetched or rewritten.
    before = (tmp_path / "a" / "model.safetensors").stat().st_mtime_ns
    r = download(hub.url, tmp_path, TINY_REPO, "--out", "a")
    assert r.returncode == 0 and "already up to date" in r.stdout
    assert (tmp_path / "a" / "model.safetensors").stat().st_mtime_ns == before


def test_revision_branch_and_commit(hub, tmp_path, hub_models):
    v1 = commit_of(hub, TINY_REPO, "v1")
    assert v1 != commit_of(hub, TINY_REPO, "main")
    r = download(hub.url, tmp_path, TINY_REPO, "--revision", "v1", "--out", "v1")
    assert r.returncode == 0, r.stderr
    assert_logits_match(tmp_path / "v1", hub_models["v1"])
    src = json.loads((tmp_path / "v1" / "manifest.json").read_text())["source"]
    assert (src["revision"], src["commit"]) == ("v1", v1)
    r = download(hub.url, tmp_path, TINY_REPO, "--revision", v1, "--out", "by-hash", "-q")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"by-hash written ({TINY_REPO}@{v1[:12]})"
    assert_logits_match(tmp_path / "by-hash", hub_models["v1"])
    # An existing checkpoint of another commit is not replaced without --force.
    r = download(hub.url, tmp_path, TINY_REPO, "--out", "v1")
    assert "already exists" in one_error_line(r) and "--force" in one_error_line(r)
    assert download(hub.url, tmp_path, TINY_REPO, "--out", "v1", "--force").returncode == 0
    assert_logits_match(tmp_path / "v1", hub_models["main"])


def test_verify_flag_runs_verify_on_the_result(hub, tmp_path):
    r = download(hub.url, tmp_path, SHARDED_REPO, "--out", "checked", "--verify", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "gpt2port verify passed" in r.stdout


def test_unknown_revision(hub, tmp_path):
    line = one_error_line(download(hub.url, tmp_path, TINY_REPO, "--revision", "no-such-branch"))
    assert TINY_REPO in line and "'no-such-branch' not found" in line


def test_bin_only_repo(hub, tmp_path, hub_models):
    r = download(hub.url, tmp_path, BIN_REPO, "--out", "bin")
    assert r.returncode == 0, r.stderr
    assert "pytorch_model.bin" in hub.file_gets()
    assert_logits_match(tmp_path / "bin", hub_models["main"])


def test_sharded_repo(hub, tmp_path, hub_models):
    r = download(hub.url, tmp_path, SHARDED_REPO, "--out", "sharded", "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    got = set(hub.file_gets())
    assert {"model.safetensors.index.json", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors"} <= got
    assert "model.safetensors" not in got
    from gpt2port import GPT

    model = GPT.from_pretrained(tmp_path / "sharded")
    assert model.tok_emb.weight.dtype == torch.bfloat16
    ref = hub_models["main"]
    with torch.no_grad():  # bf16 weights: compare with the reference rounded the same way
        ref_bf16 = type(ref)(ref.config).eval()
        ref_bf16.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in ref.state_dict().items()})
    assert_logits_match(tmp_path / "sharded", ref_bf16, dtype=torch.float32)


def test_missing_shard_fails_cleanly(hub, tmp_path):
    line = one_error_line(download(hub.url, tmp_path, BROKEN_REPO, "--out", "broken"))
    assert BROKEN_REPO in line and "model-00002-of-00002.safetensors" in line
    assert not (tmp_path / "broken").exists() and not leftovers(tmp_path / "broken")


# --- integrity and failures ----------------------------------------------------------------------------------------

def test_corrupted_body_fails_and_removes_the_bad_blob(hub, tmp_path):
    hub.set_faults({"corrupt": {"model.safetensors": -1}})  # every copy flipped; the true sha256 announced
    r = download(hub.url, tmp_path, TINY_REPO, "--out", "bad")
    line = one_error_line(r)
    assert TINY_REPO in line and "model.safetensors" in line and "integrity" in line
    assert hub.file_gets().count("model.safetensors") == 2  # the first copy, and the one retry
    assert not (tmp_path / "bad").exists() and not leftovers(tmp_path / "bad")
    cache = cache_dir(tmp_path, TINY_REPO)
    sha = sha256_of(hub, TINY_REPO, "model.safetensors")
    assert not (cache / "blobs" / sha).exists()
    assert not (cache / "snapshots" / commit_of(hub, TINY_REPO) / "model.safetensors").exists()
    # Once the Hub serves good bytes again, a rerun completes (the small files come from the cache).
    hub.reset()
    assert download(hub.url, tmp_path, TINY_REPO, "--out", "bad").returncode == 0
    assert hub.file_gets() == ["model.safetensors"]


def test_corrupted_body_once_is_fetched_again(hub, tmp_path, hub_models):
    hub.set_faults({"corrupt": {"model.safetensors": 1}})
    r = download(hub.url, tmp_path, TINY_REPO, "--out", "ok")
    assert r.returncode == 0, r.stderr
    assert "arrived corrupted" in r.stderr
    assert hub.file_gets().count("model.safetensors") == 2
    assert_logits_match(tmp_path / "ok", hub_models["main"])


def test_connection_cut_once_is_retried(hub, tmp_path, hub_models):
    size = (hub.store.resolve(TINY_REPO, "main")[1] / "model.safetensors").stat().st_size
    hub.set_faults({"cut": {"model.safetensors": {"at": size // 2, "times": 1}}})
    r = download(hub.url, tmp_path, TINY_REPO, "--out", "retried")
    assert r.returncode == 0, r.stderr
    gets = [e for e in hub.entries() if e["file"] == "model.safetensors" and e["method"] == "GET"]
    assert len(gets) == 2 and gets[0].get("cut_at") == size // 2
    # huggingface_hub keeps 10 MiB chunks in memory: below that it starts over; the full-size test sees a resume.
    assert gets[1]["range"] is None
    assert_logits_match(tmp_path / "retried", hub_models["main"])


def test_connection_cut_for_good_fails_then_rerun_completes(hub, tmp_path, hub_models):
    size = (hub.store.resolve(TINY_REPO, "main")[1] / "model.safetensors").stat().st_size
    hub.set_faults({"cut": {"model.safetensors": {"at": size // 2, "times": -1}}})
    r = download(hub.url, tmp_path, TINY_REPO, "--out", "cut")
    line = one_error_line(r)
    assert "model.safetensors" in line and "run again" in line
    assert not (tmp_path / "cut").exists() and not leftovers(tmp_path / "cut")
    blobs = cache_dir(tmp_path, TINY_REPO) / "blobs"
    assert not list(blobs.glob("*.incomplete"))
    assert not (blobs / sha256_of(hub, TINY_REPO, "model.safetensors")).exists()
    hub.reset()
    assert download(hub.url, tmp_path, TINY_REPO, "--out", "cut").returncode == 0
    assert_logits_match(tmp_path / "cut", hub_models["main"])


def test_ctrl_c_leaves_nothing_and_rerun_completes(hub, tmp_path, hub_models):
    hub.set_faults({"throttle": {"model.safetensors": 256 << 10}})  # ~25 s for the whole file
    proc = subprocess.Popen([sys.executable, "-m", "gpt2port", "download", TINY_REPO, "--out", "int"],
                            **interruptible(cwd=tmp_path, env=_env(hub.url, tmp_path), stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 60
        while not any(e["file"] == "model.safetensors" and e["method"] == "GET" and e["status"] == 200
                      for e in hub.entries()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert not (tmp_path / "int").exists() and not leftovers(tmp_path / "int")
    assert not list((cache_dir(tmp_path, TINY_REPO) / "blobs").glob("*.incomplete"))
    hub.reset()
    assert download(hub.url, tmp_path, TINY_REPO, "--out", "int").returncode == 0
    assert_logits_match(tmp_path / "int", hub_models["main"])


def test_unknown_repo(hub, tmp_path):
    line = one_error_line(download(hub.url, tmp_path, "nobody/no-such-model"))
    assert "nobody/no-such-model" in line and "not found" in line and "HF_TOKEN" in line
    assert not (tmp_path / "checkpoints").exists()


def test_unknown_name_lists_the_known_ones(tmp_path):
    from gpt2port.cli import main

    r = CliRunner().invoke(main, ["download", "gpt3"])
    assert r.exit_code == 1
    assert "unknown model name 'gpt3'" in r.output and "gpt2-medium" in r.output and "1.5B" in r.output


def test_hub_down_without_and_with_a_cached_copy(hub, tmp_path, hub_models):
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    line = one_error_line(download(dead, tmp_path, TINY_REPO, "--out", "x"))
    assert TINY_REPO in line and "cannot be reached" in line
    assert download(hub.url, tmp_path, TINY_REPO, "--out", "first").returncode == 0
    r = download(dead, tmp_path, TINY_REPO, "--out", "from-cache")
    assert r.returncode == 0, r.stderr
    assert "cannot be reached" in r.stdout  # said in the summary's warnings
    assert_logits_match(tmp_path / "from-cache", hub_models["main"])


def test_offline_mode_with_and_without_cache(hub, tmp_path, hub_models):
    line = one_error_line(download(hub.url, tmp_path, TINY_REPO, "--out", "x", offline=True))
    assert "HF_HUB_OFFLINE=1" in line and TINY_REPO in line
    assert hub.entries() == []  # offline means no network at all
    assert download(hub.url, tmp_path, TINY_REPO, "--revision", "v1", "--out", "online").returncode == 0
    hub.reset()
    r = download(hub.url, tmp_path, TINY_REPO, "--revision", "v1", "--out", "offline", offline=True)
    assert r.returncode == 0, r.stderr
    assert hub.entries() == []
    assert_logits_match(tmp_path / "offline", hub_models["v1"])
    src = json.loads((tmp_path / "offline" / "manifest.json").read_text())["source"]
    assert src["commit"] == commit_of(hub, TINY_REPO, "v1")
    # A corrupted cached blob is caught offline too (checked against its announced hash, the blob's name).
    blob = next(p for p in (cache_dir(tmp_path, TINY_REPO) / "blobs").iterdir()
                if p.name == sha256_of(hub, TINY_REPO, "model.safetensors", "v1"))
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 1
    blob.write_bytes(bytes(data))
    line = one_error_line(download(hub.url, tmp_path, TINY_REPO, "--revision", "v1", "--out", "o2", offline=True))
    assert "integrity" in line and not blob.exists()


def test_private_repo_needs_hf_token(hub_root, tmp_path, hub_models):
    with fake_hub.FakeHub(hub_root, token="hf_secret") as private:
        line = one_error_line(download(private.url, tmp_path, TINY_REPO, "--out", "p"))
        assert "not found" in line and "HF_TOKEN" in line
        private.reset()
        r = download(private.url, tmp_path, TINY_REPO, "--out", "p", HF_TOKEN="hf_secret")
        assert r.returncode == 0, r.stderr
        entries = private.entries()
        assert all(e["auth"] for e in entries if e["kind"] in ("api", "resolve"))
        assert not any(e["auth"] for e in entries if e["kind"] == "cdn")  # the token never leaves the Hub host
    assert_logits_match(tmp_path / "p", hub_models["main"])


# --- pieces --------------------------------------------------------------------------------------------------------

def test_select_files_prefers_one_safetensors_format():
    from gpt2port.hub.names import select_files

    everything = {"config.json", "vocab.json", "merges.txt", "model.safetensors", "pytorch_model.bin",
                  "tf_model.h5", "flax_model.msgpack", "rust_model.ot", "model.safetensors.index.json"}
    side, weights = select_files(everything)
    assert weights == "model.safetensors" and side == ["config.json", "vocab.json", "merges.txt"]
    assert select_files({"pytorch_model.bin", "model.safetensors.index.json"})[1] == "model.safetensors.index.json"
    assert select_files({"pytorch_model.bin", "tf_model.h5"})[1] == "pytorch_model.bin"
    assert select_files({"tf_model.h5", "flax_model.msgpack"})[1] == ""


def test_resolve_name(monkeypatch):
    from gpt2port.hub.names import resolve_name

    monkeypatch.delenv("GPT2PORT_CHECKPOINTS", raising=False)
    assert resolve_name("355M") == ("openai-community/gpt2-medium", Path("checkpoints/gpt2-medium"))
    assert resolve_name("openai-community/gpt2-xl") == ("openai-community/gpt2-xl", Path("checkpoints/gpt2-xl"))
    assert resolve_name("distilbert/distilgpt2") == ("distilbert/distilgpt2", Path("checkpoints/distilgpt2"))
    with pytest.raises(GPT2PortError, match="known: gpt2, gpt2-medium"):
        resolve_name("gpt5")


def test_not_enough_disk_space_is_refused_before_downloading(tmp_path, monkeypatch):
    from gpt2port.hub import fetch as hub_mod

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    f = hub_mod.Fetcher("org/model", None, True, lambda s: None)
    f.cache, f.commit = tmp_path, "0" * 40
    f.remote = {"model.safetensors": hub_mod.RemoteFile("model.safetensors", 1 << 50)}
    with pytest.raises(GPT2PortError, match="not enough free space.*needs 1125899.91 GB"):
        f.check_space(["model.safetensors"])
    f.remote["model.safetensors"].size = 1024
    f.check_space(["model.safetensors"])


def test_disk_full_while_downloading_is_one_line(tmp_path):
    import errno

    from gpt2port.hub import fetch as hub_mod

    f = hub_mod.Fetcher("org/model", None, True, lambda s: None)
    f.commit = "a" * 40
    msg = f._file_error("model.safetensors", OSError(errno.ENOSPC, "No space left on device"))
    assert msg.startswith("org/model@aaaaaaaaaaaa: downloading model.safetensors failed: no space left on device")


def test_fake_hub_runs_as_a_script(hub_root, tmp_path):
    """The README's demo: the stand-in as its own process, with its control endpoints."""
    proc = subprocess.Popen([sys.executable, "-m", "scripts.fake_hub", "--root", str(hub_root), "--port", "0"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().split(" on ")[1].strip()
        req = urllib.request.Request(f"{url}/_fake/faults", data=json.dumps({"corrupt": {"config.json": 1}}).encode(),
                                     method="POST")
        assert json.load(urllib.request.urlopen(req))["corrupt"] == {"config.json": 1}
        r = download(url, tmp_path, TINY_REPO, "--out", "s")
        assert r.returncode == 0 and "config.json arrived corrupted" in r.stderr  # git sha1 checks small files too
        log = json.load(urllib.request.urlopen(f"{url}/_fake/log"))
        assert [e["file"] for e in log if e["method"] == "GET" and e["file"]].count("config.json") == 2
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_fake_hub_range_and_errors(session_hub):
    """The stand-in answers like the Hub: ranges, 404s with X-Error-Code, the commit on every resolve."""
    commit, rev_dir = session_hub.store.resolve(TINY_REPO, "main")
    data = (rev_dir / "vocab.json").read_bytes()
    req = urllib.request.Request(f"{session_hub.url}/{TINY_REPO}/resolve/main/vocab.json",
                                 headers={"Range": "bytes=10-19"})
    with urllib.request.urlopen(req) as resp:
        assert resp.status == 206 and resp.read() == data[10:20]
        assert resp.headers["Content-Range"] == f"bytes 10-19/{len(data)}"
        assert resp.headers["X-Repo-Commit"] == commit
    for path, code in ((f"{TINY_REPO}/resolve/main/nope.bin", "EntryNotFound"),
                       (f"{TINY_REPO}/resolve/nope/config.json", "RevisionNotFound"),
                       ("nobody/nothing/resolve/main/config.json", "RepoNotFound")):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{session_hub.url}/{path}")
        assert e.value.code == 404 and e.value.headers["X-Error-Code"] == code


def test_hub_module_does_not_import_transformers():
    code = "import sys, gpt2port.hub, gpt2port.cli; assert 'transformers' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.heavy  # a second size of a check the default run makes on the tiny model
@pytest.mark.fullsize
def test_fullsize_gpt2_download(tmp_path_factory, tmp_path, gpt2_hf_repo):
    """124M shapes through the whole path: 0.5 GB over loopback, hashed, converted, logits equal HF's."""
    from transformers import GPT2LMHeadModel

    root = tmp_path_factory.mktemp("fake-hub-full")
    main = root / "openai-community" / "gpt2" / "main"
    main.mkdir(parents=True)
    for f in gpt2_hf_repo.iterdir():  # served through symlinks: no copy of the 0.5 GB file
        (main / f.name).symlink_to(f)
    cut = 100 * 2**20 + 12345  # past huggingface_hub's 10 MiB chunks, so it resumes with a Range request
    with fake_hub.FakeHub(root) as hub:
        hub.set_faults({"cut": {"model.safetensors": {"at": cut, "times": 1}}})
        r = download(hub.url, tmp_path, "gpt2", "--quiet", timeout=300)
        assert r.returncode == 0, r.stderr
        gets = [e for e in hub.entries() if e["file"] == "model.safetensors" and e["method"] == "GET"]
        assert [e.get("cut_at") for e in gets] == [cut, None]
        start = int(gets[1]["range"].removeprefix("bytes=").rstrip("-"))
        assert 0 < start <= cut and start % (10 * 2**20) == 0
    ref = GPT2LMHeadModel.from_pretrained(gpt2_hf_repo).eval()
    assert_logits_match(tmp_path / "checkpoints" / "gpt2", ref)



@pytest.mark.parametrize("offline", [False, True])
def test_a_cached_blob_that_is_a_link_fails_its_check_and_its_target_survives(offline, hub, tmp_path):
    """A blob of the cache replaced by a link to a user's file (a cache spread over disks, a mistake): its hash
    fails, and the user's file is neither removed nor changed; the refusal names the link."""
    assert download(hub.url, tmp_path, TINY_REPO, "--out", "first").returncode == 0
    blob = cache_dir(tmp_path, TINY_REPO) / "blobs" / sha256_of(hub, TINY_REPO, "model.safetensors")
    mine = tmp_path / "thesis.safetensors"
    mine.write_bytes(b"the user's own file, not the blob")
    blob.unlink()
    blob.symlink_to(mine)
    r = download(hub.url, tmp_path, TINY_REPO, "--out", "second", offline=offline)
    line = one_error_line(r)
    assert str(blob) in line and "link" in line and "integrity" in line, line
    assert mine.read_bytes() == b"the user's own file, not the blob" and blob.is_symlink()
    assert not (tmp_path / "second").exists()
