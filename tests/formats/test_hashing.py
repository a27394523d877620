"""The source's sha256, taken from the bytes readers offer and from the hasher's own reads: whatever the mix, the
digest is hashlib's of the whole file, and a reader never overwrites bytes the hash has not taken yet."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gpt2port import convert, hashing
from gpt2port.errors import GPT2PortError
from tests.support import run_cli
from tests.support import ROOT, FIXTURES

FIXTURES = FIXTURES / "tf"


@pytest.fixture(autouse=True)
def no_hash_left_running():
    yield
    left = [t.name for t in threading.enumerate() if t.name.startswith("gpt2port-sha256-")]
    assert not left, f"hashes left running: {left}"


@pytest.fixture
def session():
    with hashing.Hashes() as hashes:
        yield hashes


def _slow_sha256(monkeypatch, delay: float) -> None:
    """hashlib.sha256, `delay` seconds slower per update (a hash far behind its readers). Every sha256 taken is
    slowed, the outputs' records (fsio, outfile) among them, so it takes hashlib.sha256's optional data."""
    real = hashlib.sha256

    class SlowSha256:
        def __init__(self, data=b""):
            self._h = real(data)

        def update(self, data):
            time.sleep(delay)
            self._h.update(data)

        def hexdigest(self):
            return self._h.hexdigest()

    monkeypatch.setattr(hashlib, "sha256", SlowSha256)


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir()}


def _file(tmp_path: Path, size: int, seed: int = 0) -> tuple[Path, bytes]:
    data = random.Random(seed).randbytes(size)
    path = tmp_path / f"data-{seed}"
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("order", ["in order", "shuffled", "overlapping", "with gaps"])
def test_offered_pieces_in_any_order_give_the_files_digest(order, session, tmp_path, monkeypatch):
    monkeypatch.setattr(hashing, "HASH_CHUNK", 1 << 16)  # several of the hasher's own reads in a small file
    path, data = _file(tmp_path, 3_000_007)
    rng = random.Random(1)
    cuts = sorted({0, len(data), *(rng.randrange(len(data)) for _ in range(60))})
    pieces = [(a, data[a:b]) for a, b in zip(cuts, cuts[1:])]
    if order == "shuffled":
        rng.shuffle(pieces)
    elif order == "overlapping":
        pieces = [(max(0, a - 1000), data[max(0, a - 1000) : a + len(p) + 1000]) for a, p in pieces]
    elif order == "with gaps":
        pieces = pieces[::3]
    h = session.start(path)
    for offset, piece in pieces:
        h.offer(offset, piece)
    assert h.result() == hashlib.sha256(data).hexdigest()


def test_a_full_queue_drops_offers_and_the_hasher_reads_them_itself(session, tmp_path, monkeypatch):
    monkeypatch.setattr(hashing, "OFFERED", 2)
    path, data = _file(tmp_path, 5_000_000)
    h = session.start(path)
    for a in range(0, len(data), 4096):
        h.offer(a, data[a : a + 4096])
    assert h.result() == hashlib.sha256(data).hexdigest()


def test_a_reclaimed_buffer_was_hashed_before_it_is_overwritten(session, tmp_path):
    """A reader offers views of its own buffer and, after reclaiming a region, overwrites it: the digest is the
    file's; a region not reclaimed may still be on loan."""
    path, data = _file(tmp_path, 2_000_000)
    buffer = np.frombuffer(bytearray(data), dtype=np.uint8)
    loans = hashing.Loans()
    with open(path, "rb") as f:
        h = session.start(path)
        for a in range(0, len(data), 65536):
            loans.offer(session, f.fileno(), a, a, buffer[a : a + 65536])
        loans.reclaim(0, 1_000_000)
        assert h.pos >= 1_000_000
        buffer[:1_000_000] = 0
        loans.reclaim()
        buffer[:] = 0
    assert h.result() == hashlib.sha256(data).hexdigest()


def test_a_file_shorter_than_its_size_fails_naming_it(session, tmp_path, monkeypatch):
    """The file ends before the size it had when the hash started (truncated meanwhile): an error naming it."""
    path, data = _file(tmp_path, 5000)
    real_stat = os.stat

    def stat_as_before(p, *args, **kwargs):  # the size it had before it was truncated
        st = real_stat(p, *args, **kwargs)
        return st if Path(p) != path else os.stat_result((*st[:6], 1_000_000, *st[7:10]))

    monkeypatch.setattr(os, "stat", stat_as_before)
    with pytest.raises(GPT2PortError, match=str(path)):
        session.start(path).result()


@pytest.mark.parametrize("fixture", ["tiny", "sharded"])
def test_the_command_line_records_every_source_files_sha256(fixture, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / fixture, src)
    result = run_cli("convert", src, "--out", tmp_path / "ckpt", "--quiet")
    assert result.exit_code == 0, result.output
    files = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["source"]["files"]
    assert {f["name"] for f in files} >= {p.name for p in src.glob("*.data-*")} | {"model.ckpt.index"}
    for f in files:
        assert f["sha256"] == hashlib.sha256((src / f["name"]).read_bytes()).hexdigest(), f["name"]


def test_a_failed_command_leaves_no_hash_running(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "tiny", src)
    (src / "hparams.json").write_text('{"n_layer": 99, "n_head": 2, "n_embd": 8, "n_vocab": 10, "n_ctx": 4}')
    result = run_cli("convert", src, "--out", tmp_path / "ckpt", "--quiet")
    assert result.exit_code != 0 and not (tmp_path / "ckpt").exists()


def test_the_program_exits_cleanly_after_freezing_its_objects(tmp_path):
    """`python -m gpt2port` goes through cli.run (gc.freeze before exit): output complete, exit code kept."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "tiny", src)
    ok = subprocess.run([sys.executable, "-m", "gpt2port", "convert", str(src), "--out", str(tmp_path / "ckpt")],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "wrote" in ok.stdout, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "gpt2port", "info", str(tmp_path / "nowhere")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and bad.stderr.startswith("error: "), bad.stderr


@pytest.mark.parametrize("source", ["tensorflow", "safetensors"])
def test_a_reader_reusing_its_buffer_waits_for_a_slow_hash(source, tmp_path, monkeypatch):
    """Readers read every tensor into one buffer and offer the hash views of it: with the hash far behind, the next
    read must wait (hashing.Loans) rather than overwrite bytes not yet hashed."""
    from gpt2port.formats import safetensors, tf_bundle

    src = tmp_path / "src"
    if source == "tensorflow":
        shutil.copytree(FIXTURES / "tiny", src)
    else:
        convert(FIXTURES / "tiny", src, to="hf")
    expected = _digests(src)
    _slow_sha256(monkeypatch, 0.0002)
    monkeypatch.setattr(tf_bundle, "CHUNK", 256)  # many pieces per tensor...
    monkeypatch.setattr(safetensors, "READ_PIECE", 256)
    monkeypatch.setattr(hashing, "HASH_CHUNK", 256)  # ...and the hasher's own reads as slow as its hashing
    out = convert(src, tmp_path / "ckpt").out
    for f in json.loads((out / "manifest.json").read_text())["source"]["files"]:
        assert f["sha256"] == expected[f["name"]], f["name"]


def test_sessions_keep_their_hashes_apart(tmp_path):
    """Within a session a second request for a file takes over its hash; another session has its own, which a
    reader of the first never feeds and closing the first never stops. A reader given no session offers nothing."""
    from gpt2port.formats.safetensors import SafetensorsReader

    path = tmp_path / "w.safetensors"
    convert(FIXTURES / "tiny", tmp_path / "hf", to="hf")
    shutil.copy(tmp_path / "hf" / "model.safetensors", path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with hashing.Hashes() as first, hashing.Hashes() as second:
        mine, theirs = first.start(path), second.start(path)
        assert first.start(path) is mine and mine is not theirs
        with SafetensorsReader(path) as reader:  # no session: offers nothing, to anyone
            reader.read(next(iter(reader.tensors)))
        assert not mine._fed and not theirs._fed
        with SafetensorsReader(path) as reader:
            reader.hashes = first
            reader.read(next(iter(reader.tensors)))
        assert mine._fed and not theirs._fed
        first.close()
        assert theirs.result() == digest


def test_a_failed_conversion_does_not_stop_another_ones_hash(tmp_path, monkeypatch):
    """Two conversions of one source at once: the one that fails stops its own hashes only; the other records the
    source's sha256."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "tiny", src)
    expected = _digests(src)
    _slow_sha256(monkeypatch, 0.005)  # the hasher cannot finish a file on its own before a reader offers it pieces
    monkeypatch.setattr(hashing, "HASH_CHUNK", 256)
    second_running, first_failed, outcome = threading.Event(), threading.Event(), {}

    class Stop(Exception):
        pass

    def wait_for_the_failure(done, total):  # the second conversion, its hashes fed, waits for the first to fail
        second_running.set()
        first_failed.wait(60)

    def fail(done, total):
        second_running.wait(60)
        raise Stop

    def run(name, progress):
        try:
            outcome[name] = convert(src, tmp_path / name, progress=progress).out
        except BaseException as e:  # noqa: BLE001 - looked at below
            outcome[name] = e
        finally:
            if name == "first":
                first_failed.set()

    threads = [threading.Thread(target=run, args=("second", wait_for_the_failure)),
               threading.Thread(target=run, args=("first", fail))]
    threads[0].start()
    assert second_running.wait(60)
    threads[1].start()
    for t in threads:
        t.join(120)
    assert isinstance(outcome["first"], Stop)
    assert isinstance(outcome["second"], Path), outcome["second"]
    for f in json.loads((outcome["second"] / "manifest.json").read_text())["source"]["files"]:
        assert f["sha256"] == expected[f["name"]], f["name"]
