"""Fine-tuning text with no break for megabytes (one line of 'a'): tokenized in bounded pieces (memory does not grow
with the run), interruptible by Ctrl-C and SIGTERM at any moment, and a run killed outright blocks no rerun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from gpt2port.fsio import STAGE_MARK
from gpt2port.tokenizer import from_directory
from gpt2port.training import data, text
from tests.support import run_cli, snapshot
from tests.support import ROOT

WORDS = "The quick brown fox, it's said, jumps over 12 lazy dogs!\t(Twice.)  "


def child(script: str, *args) -> subprocess.Popen:
    """A fresh interpreter running `script`, with SIGINT and SIGTERM at their defaults whatever the shell set (a
    background job ignores SIGINT): the test owns the disposition it checks."""
    prelude = ("import signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
               "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n")
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(script), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


PREPARE = """
    import resource
    from gpt2port.training import data
    src, ckpt, cache = sys.argv[1:4]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        built = data.prepare(src, ckpt, cache, block_size=16, quiet=True)
    except KeyboardInterrupt:
        sys.exit(130)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    print(grown, len(built.train) + len(built.val))
"""


@pytest.fixture(scope="module")
def long_line(tmp_path_factory) -> Path:
    """8 MB of 'a' without a break, between two lines of words."""
    path = tmp_path_factory.mktemp("long") / "a.txt"
    path.write_bytes(WORDS.encode() * 20 + b"\n" + b"a" * (8 << 20) + b"\n" + WORDS.encode() * 20)
    return path


def test_a_long_run_tokenizes_in_bounded_memory(tiny_ckpt, long_line, tmp_path):
    proc = child(PREPARE, long_line, tiny_ckpt, tmp_path / "cache")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    grown, n = map(int, out.split())
    # Whole, the run is one pre-token: 188 MB measured here before pieces were bounded, growing with the run (36 MB
    # since, whatever its length).
    assert grown < 80e6, f"peak RSS grew by {grown / 1e6:.0f} MB for an 8 MB line"
    cache = data._open(tmp_path / "cache", data._read_meta(tmp_path / "cache"))
    stream = np.concatenate([cache.train, cache.val]).tolist()
    assert len(stream) == n
    assert from_directory(tiny_ckpt).decode(stream[1:]) == long_line.read_text()  # every character, once


def test_pieces_keep_the_tokens_of_text_without_line_breaks(tiny_ckpt, tmp_path, monkeypatch):
    """One long line of words: cut before spaces and tabs (never inside a whitespace run), token for token."""
    enc = from_directory(tiny_ckpt)
    whole = (WORDS * 300).replace("  ", "   \t ") + "end"
    monkeypatch.setattr(text, "PIECE", 101)
    parts = [p for _, p in text.pieces([_write(tmp_path / "line.txt", whole)])]
    assert len(parts) > 50 and max(map(len, parts)) <= 101 and "".join(parts) == whole
    assert sum((enc.encode_ordinary(p) for p in parts), []) == enc.encode_ordinary(whole)


def test_runs_are_cut_at_run_length_and_nothing_else_changes(tiny_ckpt, tmp_path, monkeypatch):
    enc = from_directory(tiny_ckpt)
    monkeypatch.setattr(text, "PIECE", 1000)
    monkeypatch.setattr(text, "RUN", 64)
    for name, run in (("letters", "a" * 1500), ("spaces", " " * 1500), ("digits", "7" * 1500)):
        whole = WORDS * 3 + run + "x" + WORDS * 3
        src = _write(tmp_path / f"{name}.txt", whole)
        for path_parts in (list(text.pieces([src])),
                           list(text.pieces([_write(tmp_path / f"{name}.jsonl", '{"text": %s}' % _json(whole))]))):
            parts = [p for _, p in path_parts]
            assert "".join(parts) == whole and max(map(len, parts)) <= 1000
            long = [p for p in parts if run[:64] in p]
            assert long and all(len(p) <= 64 + len(WORDS) * 3 for p in long)  # no piece holds more than RUN of it
            got = sum((enc.encode_ordinary(p) for p in parts), [])
            head, tail = enc.encode_ordinary(WORDS * 3)[:-1], enc.encode_ordinary(WORDS * 3)[1:]
            assert got[:len(head)] == head and got[-len(tail):] == tail  # the words around the run: as a whole
            assert enc.decode(got) == whole


def test_minified_json_is_cut_between_pre_tokens(tiny_ckpt, tmp_path, monkeypatch):
    """A long line with no space at all, but made of short pre-tokens: cut where letters, digits and punctuation
    meet, token for token (never after an apostrophe, which joins 's and 'll to what follows)."""
    import json

    enc = from_directory(tiny_ckpt)
    monkeypatch.setattr(text, "RUN", 50)
    doc = json.dumps([{"id": k, "name": f"it's item{k}", "tags": ["a", "b2", "c-3"], "v": k * 1.5} for k in range(200)],
                     separators=(",", ":")).replace(" ", "")
    parts = [p for _, p in text.pieces([_write(tmp_path / "min.json.txt", doc)])]
    assert len(parts) > 100 and max(map(len, parts)) <= 50 and "".join(parts) == doc
    assert sum((enc.encode_ordinary(p) for p in parts), []) == enc.encode_ordinary(doc)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_tokenizing_stops_it_at_once_and_leaves_nothing(tiny_ckpt, long_line, tmp_path, sig):
    before = snapshot(tmp_path)
    proc = child(PREPARE, long_line, tiny_ckpt, tmp_path / "cache")
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / f".cache.partial-{proc.pid}" / "train.bin").exists():  # tokenizing has begun
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(sig)
        proc.communicate(timeout=60)
        waited = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 130, f"exit {proc.returncode}"
    assert waited < 10, f"{waited:.1f} s from the signal to the exit"
    assert snapshot(tmp_path) == before


def test_a_stage_left_by_a_killed_run_blocks_no_rerun(tiny_ckpt, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "run"
    stale = out / f".tokens.partial-{dead.pid}"
    stale.mkdir(parents=True)
    (stale / STAGE_MARK).write_text(json.dumps({"tool": "gpt2port", "stage": stale.name}))  # as fsio.make_stage
    (stale / "train.bin").write_bytes(b"\0" * 64)
    src = _write(tmp_path / "d.txt", WORDS * 40)
    result = run_cli("finetune", tiny_ckpt, "--data", src, "--out", out, "--steps", "1", "--batch-size", "1",
                     "--block-size", "8", "--eval-every", "0", "-q")
    assert result.exit_code == 0, result.output
    assert not stale.exists() and (out / "tokens" / "train.bin").is_file()


def _write(path: Path, content: str) -> Path:
    path.write_text(content, encoding="utf-8", newline="")
    return path


def _json(s: str) -> str:
    import json

    return json.dumps(s)
