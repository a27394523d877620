"""Fine-tuning data: the token cache holds exactly the documents' tokens (the real GPT-2 tokenizer), read in
pieces without changing a token, split, reused, rebuilt when a file changes; bad data refused in one line with
nothing written; batches known from (seed, step) alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpt2port.errors import GPT2PortError
from gpt2port.tokenizer import from_directory
from gpt2port.training import data, text
from tests.support import snapshot

PARAGRAPHS = [
    "The quick brown fox jumps over the lazy dog.\n\n    Indented code();\n\tTabbed line   \n",
    "Windows lines\r\nend like this\r\n\r\nand numbers 12345 678.9 stay whole.\n\n\n",
    "Unicode: naïve café, 東京, emoji 🙂, and a literal <|endoftext|> inside the text.\n",
]


@pytest.fixture()
def tok(tiny_ckpt):
    return from_directory(tiny_ckpt)


def doc_tokens(enc, docs: list[str]) -> list[int]:
    out = []
    for d in docs:
        out += [enc.eot_token, *enc.encode_ordinary(d)]
    return out


def write(path: Path, content: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content, encoding="utf-8", newline="")
    return path


def test_the_cache_holds_every_document_token_for_token(tiny_ckpt, tok, tmp_path):
    docs = [p * 40 for p in PARAGRAPHS]
    src = tmp_path / "docs"
    for i, d in enumerate(docs):
        write(src / f"{i:02d}.txt", d)
    write(src / "notes.md", "not read: only .txt files are")
    cache = data.prepare(src, tiny_ckpt, tmp_path / "cache", block_size=16)
    stream = np.concatenate([cache.train, cache.val]).tolist()
    assert stream == doc_tokens(tok, docs)
    assert tok.decode(stream).count("<|endoftext|>") == len(docs) + 40  # 3 separators, 40 literal ones in text
    assert len(cache.val) == max(-(-len(stream) * 5 // 100), 17)
    assert cache.meta["n_documents"] == 3 and cache.train.dtype == np.uint16
    assert (tmp_path / "cache" / "train.bin").stat().st_size == 2 * len(cache.train)  # nanoGPT's format


def test_pieces_encode_exactly_as_the_whole_text(tok, tmp_path, monkeypatch):
    whole = "".join(PARAGRAPHS) * 30 + "   \n \n\nend"
    monkeypatch.setattr(text, "PIECE", 97)  # many cuts, in every kind of place
    parts = list(text.pieces([write(tmp_path / "a.txt", whole)]))
    assert len(parts) > 20 and "".join(p for _, p in parts) == whole
    assert [s for s, _ in parts] == [True] + [False] * (len(parts) - 1)
    assert sum((tok.encode_ordinary(p) for _, p in parts), []) == tok.encode_ordinary(whole)


def test_jsonl_documents(tiny_ckpt, tok, tmp_path):
    lines = [json.dumps({"text": p, "id": i}) for i, p in enumerate(PARAGRAPHS * 20)]
    src = write(tmp_path / "d.jsonl", "\n".join(lines[:30]) + "\n\n" + "\n".join(lines[30:]) + "\n")
    cache = data.prepare(src, tiny_ckpt, tmp_path / "cache", block_size=8)
    assert np.concatenate([cache.train, cache.val]).tolist() == doc_tokens(tok, PARAGRAPHS * 20)


def test_reused_when_unchanged_rebuilt_when_a_file_changes(tiny_ckpt, tmp_path):
    src = write(tmp_path / "a.txt", PARAGRAPHS[0] * 50)
    cache_dir = tmp_path / "cache"
    data.prepare(src, tiny_ckpt, cache_dir, block_size=16)
    before = snapshot(cache_dir)
    data.prepare(src, tiny_ckpt, cache_dir, block_size=16)
    assert snapshot(cache_dir) == before
    write(src, PARAGRAPHS[1] * 50)
    cache = data.prepare(src, tiny_ckpt, cache_dir, block_size=16)
    assert snapshot(cache_dir) != before and cache.meta["sources"][0]["size"] == src.stat().st_size


@pytest.mark.parametrize("case, named", [
    ("missing", "no such file"),
    ("empty", "empty file"),
    ("whitespace", "only whitespace"),
    ("nul", "NUL byte at offset 5"),
    ("latin1", "invalid byte at offset 6"),  # c a f, é as UTF-8 (2 bytes), a space, then é as Latin-1
    ("no-txt", "no .txt files"),
    ("jsonl-bad", "d.jsonl:1: not a JSON line"),
    ("jsonl-no-text", "d.jsonl:1: needs a JSON object"),
    ("jsonl-all-empty", "no line has a non-empty"),
    ("too-short", "needs at least"),
])
def test_bad_data_is_refused_in_one_line_with_nothing_written(case, named, tiny_ckpt, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    path = {
        "missing": src / "nope.txt",
        "empty": src / "e.txt",
        "whitespace": src / "w.txt",
        "nul": src / "n.txt",
        "latin1": src / "l.txt",
        "no-txt": src,
        "jsonl-bad": src / "d.jsonl",
        "jsonl-no-text": src / "d.jsonl",
        "jsonl-all-empty": src / "d.jsonl",
        "too-short": src / "s.txt",
    }[case]
    content = {"empty": b"", "whitespace": b" \n\t\n", "nul": b"hello\0world", "latin1": b"caf\xc3\xa9 \xe9t\xe9",
               "jsonl-bad": b"{not json}\n", "jsonl-no-text": b'{"body": "x"}\n',
               "jsonl-all-empty": b'{"text": ""}\n{"text": ""}\n', "too-short": b"Only a few words here.\n"}
    if case in content:
        path.write_bytes(content[case])
    if case == "no-txt":
        (src / "x.bin").write_bytes(b"\1\2")
    before = snapshot(tmp_path)
    with pytest.raises(GPT2PortError) as e:
        data.prepare(path, tiny_ckpt, tmp_path / "out" / "cache", block_size=16)
    message = str(e.value)
    assert "\n" not in message and named in message and str(path) in message
    assert snapshot(tmp_path) == before


def test_a_bad_byte_deep_in_a_big_file_leaves_nothing(tiny_ckpt, tmp_path):
    """documents() peeks at each file's start; the rest is checked while tokenizing, in a stage that vanishes."""
    src = tmp_path / "big.txt"
    src.write_bytes(PARAGRAPHS[0].encode() * 3000 + b"\xff tail\n")
    before = snapshot(tmp_path)
    with pytest.raises(GPT2PortError, match=f"invalid byte at offset {len(PARAGRAPHS[0].encode()) * 3000}"):
        data.prepare(src, tiny_ckpt, tmp_path / "cache", block_size=16)
    assert snapshot(tmp_path) == before


def test_ctrl_c_while_tokenizing_leaves_nothing(tiny_ckpt, tmp_path, monkeypatch):
    src = write(tmp_path / "a.txt", PARAGRAPHS[0] * 500)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(data, "_split", interrupted)
    before = snapshot(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        data.prepare(src, tiny_ckpt, tmp_path / "cache", block_size=16)
    assert snapshot(tmp_path) == before


def test_batches_come_from_seed_and_step_alone():
    a = data.sample_offsets(10_000, 64, seed=3, step=7, count=32)
    assert a.dtype == np.int64 and a.min() >= 0 and a.max() <= 10_000 - 65
    assert np.array_equal(a, data.sample_offsets(10_000, 64, seed=3, step=7, count=32))
    assert not np.array_equal(a, data.sample_offsets(10_000, 64, seed=3, step=8, count=32))
    assert not np.array_equal(a, data.sample_offsets(10_000, 64, seed=4, step=7, count=32))


def test_windows_and_eval_offsets():
    stream = np.arange(1000, dtype=np.uint16)
    x, y = data.windows(stream, [0, 10, 935], 64)
    assert x.shape == y.shape == (3, 64) and x.dtype.is_floating_point is False
    assert x[2, 0] == 935 and y[2, -1] == 999 and bool((y[:, :-1] == x[:, 1:]).all())
    for n, block, k in [(1000, 64, 4), (1000, 64, 100), (65, 64, 8), (5000, 7, 13)]:
        o = data.eval_offsets(n, block, k)
        assert len(o) >= 1 and o.min() >= 0 and o.max() + block + 1 <= n
        assert (np.diff(o) >= block).all() and len(o) <= k
        assert np.array_equal(o, data.eval_offsets(n, block, k))
