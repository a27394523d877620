"""Fine-tuning text: which files a data path means, checked for what would make training on it meaningless
(empty, only whitespace, binary, not UTF-8, JSON lines without text, a model's files, anything but a regular file),
and read back as documents in pieces of bounded size.

A piece ends where GPT-2's pre-tokenizer joins nothing across the cut: right after a lone newline between two
non-space characters, or right before a space, tab or line break that follows a non-space character. Encoding the
pieces one by one then gives exactly the tokens of the whole text, without holding a multi-gigabyte file as one
string. Text with no such point for PIECE characters (a line of 50 million 'a') is cut at PIECE anyway, and a run
of RUN characters without one is cut where ASCII letters, digits and punctuation meet (minified JSON), else every RUN
characters: the tokenizer's cost of one pre-token grows with its length (about 55 bytes of memory per character),
and no natural text has a "word" that long. Only there can the tokens at the cut differ from those of the whole run.
"""

from __future__ import annotations

import codecs
import re
from pathlib import Path
from typing import Iterator

from gpt2port import inputs, jsonio
from gpt2port.errors import GPT2PortError

PIECE = 1 << 20  # characters per piece, at most: enough to keep tokenizer threads busy, small enough to stream
RUN = 1 << 15  # the longest run without a cut point that is tokenized whole (see the module docstring)
_BREAK = re.compile(r"[ \t\r\n]\S")  # searched in reversed text: the last break after a non-space character
_PUNCT = r"!-&(-/:-@\[-`{-~"  # ASCII punctuation but the apostrophe
_SWITCH = re.compile(rf"[{_PUNCT}][A-Za-z0-9]|[A-Za-z0-9][{_PUNCT}]|[A-Za-z][0-9]|[0-9][A-Za-z]")  # reversed, too
PEEK = 1 << 16  # bytes read at a time while checking a file before anything is written


def documents(data: str | Path) -> list[Path]:
    """The source files of a data path, checked before anything is written: a text file, a directory (every *.txt
    under it, sorted by relative path) or a .jsonl file (one JSON object per line with a "text" string). Each is a
    regular file holding more than whitespace; nothing that is not a regular file is opened (a FIFO would block)."""
    path = Path(data)
    if not path.exists():
        raise GPT2PortError(f"{path}: no such file or directory")
    if path.is_dir():
        if _model_files(path):
            raise GPT2PortError(f"{path}: a model directory ({', '.join(_model_files(path))}), not text to "
                                f"fine-tune on")
        found = sorted((p for p in path.rglob("*.txt") if not p.is_dir()), key=lambda p: p.relative_to(path).parts)
        if not found:
            others = sum(1 for p in path.rglob("*") if p.is_file())
            raise GPT2PortError(f"{path}: no .txt files in this directory ({others} other file(s))")
        nonempty = [f for f in found if _kind(f)]
        if not nonempty:
            raise GPT2PortError(f"{path}: every .txt file in this directory is empty")
        for f in nonempty:
            _peek(f)
        return nonempty
    if not _kind(path):
        raise GPT2PortError(f"{path}: empty file")
    _peek(path)
    if is_jsonl(path):
        with inputs.open_binary(path) as f:
            _json_text(f.readline(), path, 1)
    return [path]


MODEL_FILES = ("config.json", "model.safetensors", "pytorch_model.bin", "manifest.json")


def _model_files(d: Path) -> list[str]:
    """What makes `d` a model's directory rather than text: its config, weights, manifest or BPE tokenizer pair
    (merges.txt is a .txt file, and a checkpoint directory's text would be its merges)."""
    names = [n for n in MODEL_FILES if (d / n).is_file()]
    if (d / "merges.txt").is_file() and (d / "vocab.json").is_file():
        names += ["vocab.json", "merges.txt"]
    return names


def _kind(path: Path) -> bool:
    """Whether the file has bytes (False: empty); refuses what the gate refuses (not a regular file, a file of /proc
    or /sys, whose size says nothing), and a model's tokenizer file."""
    inputs.checked(path, "a text file")
    st = path.stat()
    if path.name == "merges.txt" and (path.parent / "vocab.json").is_file():
        raise GPT2PortError(f"{path}: a model's tokenizer file (beside vocab.json), not text to fine-tune on")
    if st.st_size:
        return True
    with inputs.open_binary(path) as f:
        if f.read(1):
            raise GPT2PortError(f"{path}: its size reads 0 but it holds bytes (a special file: its size cannot be "
                                f"known), not a text file")
    return False


def is_jsonl(path: Path) -> bool:
    return path.suffix.lower() == ".jsonl"


def _peek(path: Path) -> None:
    """Refuse a file that is binary, not UTF-8 or only whitespace, reading up to the first text (the whole file if
    it is all whitespace, whatever its size); the rest is checked while tokenizing."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, text = 0, False
    with inputs.open_binary(path) as f:
        while chunk := f.read(PEEK):
            _check_bytes(chunk, path, offset)
            text = text or bool(_decode(chunk, path, offset, decoder, final=False).strip())
            offset += len(chunk)
            if text and len(chunk) == PEEK:
                return
    _decode(b"", path, offset, decoder, final=True)
    if not text:
        raise GPT2PortError(f"{path}: holds only whitespace")


def _check_bytes(chunk: bytes, path: Path, offset: int) -> None:
    nul = chunk.find(b"\0")
    if nul >= 0:
        raise GPT2PortError(f"{path}: binary file (NUL byte at offset {offset + nul}); fine-tuning reads UTF-8 text")


def _decode(chunk: bytes, path: Path, offset: int, decoder=None, final: bool = True) -> str:
    try:
        if decoder is None:
            return chunk.decode("utf-8")
        return decoder.decode(chunk, final=final)
    except UnicodeDecodeError as e:
        raise GPT2PortError(f"{path}: not UTF-8 text (invalid byte at offset {offset + e.start})") from None


def _json_text(line: bytes, path: Path, number: int) -> str:
    obj = jsonio.loads(line, f"{path}:{number}", "not a JSON line")
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        raise GPT2PortError(f"{path}:{number}: needs a JSON object with a \"text\" string")
    return obj["text"]


def pieces(files: list[Path]) -> Iterator[tuple[bool, str]]:
    """(starts a document, text) for every piece of every document, in order, checking every byte on the way."""
    for path in files:
        if is_jsonl(path):
            yield from _jsonl_pieces(path)
        else:
            yield from _file_pieces(path)


def _file_pieces(path: Path) -> Iterator[tuple[bool, str]]:
    decoder = codecs.getincrementaldecoder("utf-8")()
    carry, offset, first = "", 0, True
    with inputs.open_binary(path) as f:
        while chunk := f.read(PIECE):
            _check_bytes(chunk, path, offset)
            carry += _decode(chunk, path, offset, decoder, final=False)
            offset += len(chunk)
            while len(carry) > PIECE:  # the text known so far holds at most two pieces
                cut = _cut(carry[:PIECE])
                yield from _runs(first, carry[:cut])
                carry, first = carry[cut:], False
        carry += _decode(b"", path, offset, decoder, final=True)
    if carry or first:
        yield from _runs(first, carry)


def _jsonl_pieces(path: Path) -> Iterator[tuple[bool, str]]:
    texts = 0
    with inputs.open_binary(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            text = _json_text(line, path, number)
            if not text:
                continue
            texts += 1
            start = 0
            while len(text) - start > PIECE:  # a long document: split where tokenization allows
                cut = _cut(text[start : start + PIECE])
                yield from _runs(start == 0, text[start : start + cut])
                start += cut
            yield from _runs(start == 0, text[start:])
    if not texts:
        raise GPT2PortError(f"{path}: no line has a non-empty \"text\"")


def _cut(window: str) -> int:
    """Where a piece of at most len(window) characters ends: the last point that keeps the tokens, else the end."""
    return max(_last_cut(window), _last_break(window)) or len(window)


def _last_break(text: str) -> int:
    """The last point right before a space, tab or line break that follows a non-space character (0: none). The
    pre-token ending at that character ends there (no pattern but a whitespace run spans a space, and none starts
    with a non-space character), and the next one starts there whatever came before."""
    m = _BREAK.search(text[::-1])
    return len(text) - 1 - m.start() if m else 0


def _runs(first: bool, piece: str) -> Iterator[tuple[bool, str]]:
    """The piece, with every run of RUN characters holding no break cut apart: at its last switch between ASCII
    letters, digits and punctuation (a pre-token boundary too: minified JSON keeps its tokens), else after RUN."""
    start = 0
    while len(piece) - start >= RUN and (m := _long_run().search(piece, start)):
        end = m.start() + (_last_switch(m.group()) or RUN)
        yield first, piece[start:end]
        start, first = end, False
    if start < len(piece) or start == 0:
        yield first, piece[start:]


def _last_switch(text: str) -> int:
    """The last point between an ASCII letter or digit and ASCII punctuation, or between a letter and a digit (0:
    none). The apostrophe is left out: it begins the contractions ('s, 'll, ...) that join it to letters."""
    m = _SWITCH.search(text[::-1])
    return len(text) - 1 - m.start() if m else 0


def _long_run() -> re.Pattern:
    # Built on use: RUN is read at call time (tests lower it); re caches the compiled pattern.
    return re.compile(rf"[^ \t\r\n]{{{RUN}}}|[ \t\r\n]{{{RUN}}}")


def _last_cut(text: str) -> int:
    """The last point in `text` where it may be cut without changing its tokens (0: none): right after a newline
    with no whitespace on either side. A longer whitespace run must not end a piece: at the end of a string the
    tokenizer keeps a run whole, where the same run before a letter gives up its last character to the next token.
    str.isspace() counts every character the tokenizer's \\s does (and a few more), so such a point is safe."""
    i = len(text) - 1  # a newline at the very end is not a point yet: what follows it is unknown
    while (i := text.rfind("\n", 0, i)) > 0:
        if not text[i + 1].isspace() and not text[i - 1].isspace():
            return i + 1
    return 0
