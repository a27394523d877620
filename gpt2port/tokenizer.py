"""GPT-2's byte-level BPE as a tiktoken.Encoding, built from a checkpoint's own files: no network, ever.

`tiktoken.get_encoding("gpt2")` downloads OpenAI's files at run time. We build the same Encoding from the files that
travel with the checkpoint, in whichever of the three layouts it has:

    vocab.json + merges.txt     Hugging Face's names (every GPT-2 repo on the Hub, and our converted checkpoints)
    encoder.json + vocab.bpe    OpenAI's original release (the same bytes under other names)
    tokenizer.json              what transformers >= 5 save_pretrained writes (vocab and merges inside one file)

We parse the files ourselves rather than call tiktoken.load.data_gym_to_mergeable_bpe_ranks: that function reads
through tiktoken's download cache, which copies every local file into $TMPDIR/data-gym-cache under a key made from
the *path* alone and, with no expected hash, serves that copy back even after the file at the path has changed.

tiktoken merges the adjacent pair whose merged token has the lowest id; HF's BPE merges the pair listed earliest in
merges.txt. The two agree exactly when token ids follow merge order (256 byte tokens first, then one token per merge
line), which GPT-2's files do. We check that and refuse a vocabulary where it does not hold, instead of encoding it
differently from the reference.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import tiktoken
from tiktoken_ext.openai_public import r50k_pat_str

from gpt2port import inputs, jsonio
from gpt2port.errors import GPT2PortError
from gpt2port.filekind import real

ENDOFTEXT = "<|endoftext|>"
ENDOFTEXT_ID = 50256  # GPT-2's id for it
VOCAB_MERGES = (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"))  # HF names, OpenAI names
TOKENIZER_JSON = "tokenizer.json"
# Every tokenizer file that travels with a checkpoint: the three layouts above plus transformers' settings files.
TOKENIZER_FILES = (*VOCAB_MERGES[0], TOKENIZER_JSON, "tokenizer_config.json", "special_tokens_map.json",
                   *VOCAB_MERGES[1])


# What a conversion of weights without tokenizer files says about it (in its warning and the manifest's).
NO_TOKENIZER = ("converted without tokenizer files: loading in Python works, but `gpt2port generate` and text prompts "
                "need vocab.json + merges.txt, encoder.json + vocab.bpe, or tokenizer.json beside the weights")


SIDE_FILE_LIMIT = 64 << 20  # bytes: GPT-2's largest tokenizer file (tokenizer.json) has 1.4 MB


def side_file_problem(path: Path) -> str | None:
    """Why a file under a tokenizer file's name is not one (None: it has the shape of one). A conversion carries
    these files into its output, so a link named vocab.json that leads to a private file must not pass."""
    path = Path(path)
    try:
        raw = inputs.read_bytes(path, SIDE_FILE_LIMIT, "a tokenizer file")
    except OSError as e:
        return e.strerror or str(e)
    except GPT2PortError as e:  # its message names the path first: the reason is what follows
        return str(e).removeprefix(f"{path}: ")
    if path.name in (VOCAB_MERGES[0][1], VOCAB_MERGES[1][1]):  # merges.txt, vocab.bpe
        try:
            lines = raw.decode("utf-8").split("\n")
        except UnicodeDecodeError:
            return "not UTF-8 text"
        pairs = [line for line in lines[1 if lines[0].startswith("#version") else 0:] if line]
        bad = next((n for n, line in enumerate(pairs) if len(line.split(" ")) != 2), None)
        return None if pairs and bad is None else "not a '#version' line and 'left right' merge pairs"
    try:
        data = jsonio.loads(raw, path)
    except GPT2PortError:
        return "not JSON"
    if path.name in (VOCAB_MERGES[0][0], VOCAB_MERGES[1][0]):  # vocab.json, encoder.json: token -> id
        ok = isinstance(data, dict) and len(data) >= 256 and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in data.values()) \
            and len(set(data.values())) == len(data)
        return None if ok else "not a JSON object of at least 256 tokens with distinct ids"
    if not isinstance(data, dict):
        return "not a JSON object"
    if path.name == TOKENIZER_JSON and not isinstance(data.get("model"), dict):
        return "not a tokenizer.json (no \"model\" object)"
    return None


def defines_tokenizer(files) -> bool:
    """Whether these files (paths or names) include one complete set that defines GPT-2's tokenizer."""
    names = {Path(f).name for f in files}
    return TOKENIZER_JSON in names or any(set(pair) <= names for pair in VOCAB_MERGES)


def from_directory(directory: str | Path) -> tiktoken.Encoding:
    """The tokenizer in a directory holding GPT-2 BPE files: a converted checkpoint or a plain HF repo directory
    (gpt2port.load_tokenizer also takes a NAME)."""
    return _cached(*_tokenizer_key(Path(directory)))


def _tokenizer_key(directory: Path) -> tuple:
    """Which files define the tokenizer, plus their size and mtime: an edited file is parsed again, not served stale."""
    for pair in VOCAB_MERGES:
        files = [directory / name for name in pair]
        if all(f.is_file() for f in files):
            break
    else:
        files = [directory / TOKENIZER_JSON]
        if not files[0].is_file():
            raise GPT2PortError(f"{directory}: no GPT-2 tokenizer files (needs vocab.json + merges.txt, "
                                f"encoder.json + vocab.bpe, or tokenizer.json)")
    files = [real(f) for f in files]
    return tuple(files), tuple((f.stat().st_size, f.stat().st_mtime_ns) for f in files)


@lru_cache(maxsize=8)
def _cached(files: tuple[Path, ...], _stamp: tuple) -> tiktoken.Encoding:
    # Parsing 50k merges takes a few hundred ms; a process that loads the same checkpoint twice pays it once.
    vocab, merges, specials, where = _parse(files)
    ranks = _mergeable_ranks(vocab, merges, where)
    if specials.get(ENDOFTEXT) is None:
        specials[ENDOFTEXT] = len(ranks)  # the id right after the last merge: 50256 in GPT-2
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens=specials)


def _parse(files: tuple[Path, ...]) -> tuple[dict, list, dict, str]:
    """(vocab without specials, merges, specials {token: id or None}, a name for messages) of either layout."""
    if len(files) == 2:
        vocab_path, merges_path = files
        vocab = _read_json(vocab_path)
        merges = _read_merges(merges_path)
        return vocab, merges, {ENDOFTEXT: vocab.pop(ENDOFTEXT, None)}, f"{vocab_path} + {merges_path.name}"
    vocab, merges, specials = _read_tokenizer_json(files[0])
    return vocab, merges, specials, str(files[0])


def bpe_tables(directory: str | Path) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """The tokenizer of a directory as plain tables, for formats that embed it (GGUF): every token's byte-level
    string by id, the merges in priority order, and the special tokens. Checked as from_directory checks it."""
    files, _ = _tokenizer_key(Path(directory))
    vocab, merges, specials, where = _parse(files)
    ranks = _mergeable_ranks(vocab, merges, where)
    if specials.get(ENDOFTEXT) is None:
        specials[ENDOFTEXT] = len(ranks)
    by_id = {**{i: t for t, i in vocab.items()}, **{i: t for t, i in specials.items()}}
    if sorted(by_id) != list(range(len(by_id))):
        raise GPT2PortError(f"{where}: token ids are not 0..{len(by_id) - 1} without gaps")
    return [by_id[i] for i in range(len(by_id))], merges, list(specials)


def write_bpe_files(directory: Path, tokens: list[str], merges: list[tuple[str, str]]) -> list[Path]:
    """vocab.json + merges.txt (Hugging Face's names and formats) in `directory`, from bpe_tables-style tables."""
    vocab_path, merges_path = (Path(directory) / n for n in VOCAB_MERGES[0])
    vocab_path.write_text(json.dumps({t: i for i, t in enumerate(tokens)}, ensure_ascii=False), encoding="utf-8")
    merges_path.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    return [vocab_path, merges_path]


def _read_json(path: Path):
    return inputs.read_json(path)


def _read_merges(path: Path) -> list[tuple[str, str]]:
    """merges.txt / vocab.bpe: a '#version' header, then one 'left right' pair per line, highest priority first."""
    merges = []
    for n, line in enumerate(inputs.read_text(path, SIDE_FILE_LIMIT, "a merges file").split("\n"), start=1):
        if not line or line.startswith("#version"):
            continue
        pair = line.split(" ")
        if len(pair) != 2:
            raise GPT2PortError(f"{path}: line {n} is not a 'left right' merge pair: {line[:60]!r}")
        merges.append((pair[0], pair[1]))
    return merges


def _read_tokenizer_json(path: Path) -> tuple[dict, list, dict]:
    data = _read_json(path)
    model = data.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(data.get("pre_tokenizer")):
        raise GPT2PortError(f"{path}: not a byte-level BPE tokenizer (GPT-2's kind)")
    # Merges are "left right" strings in older files, [left, right] lists since tokenizers 0.20.
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    vocab = dict(model.get("vocab", {}))
    specials = {}
    for added in data.get("added_tokens", []):
        vocab.pop(added["content"], None)
        specials[added["content"]] = added["id"]
    return vocab, merges, specials


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for raw bytes (its bytes_to_unicode), inverted: character -> byte."""
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def _mergeable_ranks(vocab: dict[str, int], merges: list[tuple[str, str]], where: str) -> dict[bytes, int]:
    byte_of = _byte_decoder()

    def to_bytes(token: str) -> bytes:
        try:
            return bytes(byte_of[c] for c in token)
        except KeyError:
            raise GPT2PortError(f"{where}: token {token!r} is not in GPT-2's byte-level alphabet") from None

    ranks = {to_bytes(token): i for token, i in vocab.items()}
    # The ids tiktoken needs: byte tokens in GPT-2's order, then one per merge line. They must be the file's ids.
    expected = {to_bytes(c): i for i, c in enumerate(byte_of)}
    for a, b in merges:
        expected.setdefault(to_bytes(a) + to_bytes(b), len(expected))
    if ranks != expected:
        raise GPT2PortError(f"{where}: vocabulary ids do not follow merge order as in GPT-2's BPE "
                            f"({len(ranks)} tokens, {len(merges)} merges); tiktoken cannot reproduce it exactly")
    return ranks


class StreamDecoder:
    """Turns tokens into text as they arrive. A character may span tokens (most emoji and CJK take two or three), so
    bytes are decoded incrementally: an incomplete UTF-8 sequence waits for its next token instead of printing as
    U+FFFD. Invalid bytes (a model can emit any) become U+FFFD, as in HF's decode(errors="replace").

    stop: strings the text ends before (HF's stop_strings). Text that may be the start of one is held back until
    the next tokens tell; once one appears, `stopped` is set and nothing more comes out."""

    def __init__(self, encoding: tiktoken.Encoding, stop: Sequence[str] = ()):
        self.encoding = encoding
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = [s for s in stop if s]
        self.stopped = False
        self._held = ""

    def push(self, tokens) -> str:
        text = self._utf8.decode(b"".join(self.encoding.decode_single_token_bytes(int(t)) for t in tokens))
        return self._until_stop(text) if self.stop else text

    def flush(self) -> str:
        text = self._until_stop(self._utf8.decode(b"", final=True))
        held, self._held = self._held, ""
        return text + held

    def _until_stop(self, text: str) -> str:
        if self.stopped:
            return ""
        text = self._held + text
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if found:
            self.stopped, self._held = True, ""
            return text[:min(found)]
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self._held = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]


# --- GPT-2's files from a bare list of token bytes (llm.c's tokenizer file) ------------------------------------

def vocab_and_merges(tokens: list[bytes], eot: int, where: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(every token's byte-level string by id, the merges in priority order) for a byte-level BPE given only its
    tokens' bytes in id order: the tables write_bpe_files takes.

    Ids are merge ranks in GPT-2's BPE, so each token past the 256 byte tokens is the merge of the two pieces that
    BPE, restricted to lower ranks, leaves of it: the merge list follows from the tokens alone. Refuses tokens that
    are not such a BPE (the byte tokens out of GPT-2's order, a token no two earlier ones make, the end-of-text
    token anywhere but last)."""
    byte_of = _byte_decoder()
    char_of = {b: c for c, b in byte_of.items()}
    expected_bytes = [bytes([b]) for b in byte_of.values()]
    if eot != len(tokens) - 1 or tokens[:256] != expected_bytes or tokens[eot] != ENDOFTEXT.encode():
        raise GPT2PortError(f"{where}: not GPT-2's byte-level BPE (byte tokens, end-of-text id {eot} or its text "
                            f"differ)")
    ranks = {t: i for i, t in enumerate(tokens[:eot])}
    if len(ranks) != eot:
        raise GPT2PortError(f"{where}: holds the same token twice")

    def text(b: bytes) -> str:
        return "".join(char_of[x] for x in b)

    merges = []
    for rank in range(256, eot):
        left, right = _split(ranks, tokens[rank], rank, where)
        merges.append((text(left), text(right)))
    return [text(t) for t in tokens[:eot]] + [ENDOFTEXT], merges


def _split(ranks: dict[bytes, int], token: bytes, max_rank: int, where: str) -> tuple[bytes, bytes]:
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], max_rank))
        if ranks.get(parts[best] + parts[best + 1], max_rank) >= max_rank:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    if len(parts) != 2:
        raise GPT2PortError(f"{where}: token {ranks.get(token, max_rank)} ({token!r}) is not the merge of two "
                            f"earlier tokens, as byte-level BPE requires")
    return parts[0], parts[1]
