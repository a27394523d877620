"""The input files, read whole and checked before any model runs: every refusal is one line naming the file, and
for a jsonl file the line number (counted from 1, as an editor counts) and the field at fault."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gpt2port import inputs
from gpt2port.errors import GPT2PortError


def read_text(path: str | Path, data: bytes | None = None) -> str:
    """The file's text (data: its bytes, when they were read from an archive), read through the gate."""
    path = Path(path)
    data = inputs.read_bytes(path, inputs.LIMITS["eval data"], "a --data file") if data is None else data
    if not data.strip():
        raise GPT2PortError(f"{path}: is empty")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GPT2PortError(f"{path}: not UTF-8 text (byte {e.start})") from None


def read_jsonl(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line."""
    rows = inputs.read_jsonl(path, inputs.LIMITS["eval data"], what="a --data file")
    if not rows:
        raise GPT2PortError(f"{path}: is empty")
    return rows


def field(path, number: int, obj: dict, key: str, kind: type = str):
    value = obj.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        what = {str: "a string", list: "a list"}.get(kind, kind.__name__)
        said = "missing" if key not in obj else f"not {what}"
        raise GPT2PortError(f"{path}: line {number}: field {key!r} {said}")
    return value


# --- LAMBADA -----------------------------------------------------------------------------------------------------

@dataclass
class Pair:
    """One log-likelihood request: a context and the continuation(s) scored after it."""
    context: str
    continuations: list[str]
    label: int = 0  # which continuation is right (multiple choice)
    norms: list[float] | None = None  # what each continuation's log-likelihood is divided by for acc_norm


def lambada(path) -> list[Pair]:
    """LAMBADA OpenAI's jsonl: a "text" per line; the context is all but its last word, the continuation " " + it
    (the harness's lambada_openai: split on single spaces)."""
    pairs = []
    for number, obj in read_jsonl(path):
        words = field(path, number, obj, "text").split(" ")
        if len(words) < 2:
            raise GPT2PortError(f"{path}: line {number}: text has no last word to predict (one word)")
        if not words[-1].strip():  # " " alone would be scored: no word, a figure of nothing
            raise GPT2PortError(f"{path}: line {number}: text ends in a space; it has no last word to predict")
        pairs.append(Pair(" ".join(words[:-1]), [" " + words[-1]]))
    if not pairs:
        raise GPT2PortError(f"{path}: holds no example")
    return pairs


# --- HellaSwag ---------------------------------------------------------------------------------------------------

def harness_preprocess(text: str) -> str:
    """lm-evaluation-harness's hellaswag preprocess (WikiHow's bracketed artifacts removed)."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag(path, protocol: str = "harness") -> list[Pair]:
    """HellaSwag's jsonl. harness: query = preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize()),
    continuation " " + preprocess(ending), acc_norm divides by the ending's length in characters. nanogpt
    (build-nanogpt's and llm.c's hellaswag.py): context = ctx as it is, continuation " " + ending, acc_norm divides
    by the ending's length in tokens (left to the scorer: norms None)."""
    pairs = []
    for number, obj in read_jsonl(path):
        endings = field(path, number, obj, "endings", list)
        if not endings or not all(isinstance(e, str) for e in endings):
            raise GPT2PortError(f"{path}: line {number}: field 'endings' is not a non-empty list of strings")
        label = _label(path, number, obj, len(endings))
        if protocol == "nanogpt":
            _nonempty(path, number, endings, "")
            pairs.append(Pair(field(path, number, obj, "ctx"), [" " + e for e in endings], label))
            continue
        ctx = field(path, number, obj, "ctx_a") + " " + field(path, number, obj, "ctx_b").capitalize()
        query = harness_preprocess(field(path, number, obj, "activity_label") + ": " + ctx)
        choices = [harness_preprocess(e) for e in endings]
        _nonempty(path, number, choices, " after the harness's preprocessing")  # acc_norm divides by its length
        pairs.append(Pair(query, [" " + c for c in choices], label, [float(len(c)) for c in choices]))
    if not pairs:
        raise GPT2PortError(f"{path}: holds no example")
    return pairs


def _nonempty(path, number: int, endings: list[str], after: str) -> None:
    """An empty context is scored as the harness scores it (after the end-of-text token); an empty ending is not
    scored at all: it has no length to normalize by, no token of its own."""
    empty = next((i for i, e in enumerate(endings) if not e.strip()), None)
    if empty is not None:
        raise GPT2PortError(f"{path}: line {number}: ending {empty} is empty{after}")


def _label(path, number: int, obj: dict, n: int) -> int:
    """The published files hold an int; the Hub's copy a string of one."""
    value = obj.get("label")
    if isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]{1,9}\s*", value):  # ASCII digits, few enough for int()
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        said = "missing" if "label" not in obj else "not an integer"
        raise GPT2PortError(f"{path}: line {number}: field 'label' {said}")
    if not 0 <= value < n:
        raise GPT2PortError(f"{path}: line {number}: label {str(value)[:20]} is out of range (0-{n - 1} for {n} "
                            f"endings)")
    return value
