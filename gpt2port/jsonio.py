"""Parsing JSON that came from a file: the one parser every reader of a JSON file goes through (the file itself is
read through gpt2port/inputs.py, the gate).

json.loads on a hostile file fails in more ways than JSONDecodeError: RecursionError for arrays nested 100k deep,
a plain ValueError for an integer of more digits than int() converts, UnicodeDecodeError for bytes that are not
UTF-8. Each becomes one line naming the file. Nesting is also bounded after parsing (a value nested 900 deep parses,
then breaks whatever walks it recursively: repr in an error message, json.dumps): no file gpt2port reads nests
deeper than MAX_DEPTH.
"""

from __future__ import annotations

import json

from gpt2port.errors import GPT2PortError

MAX_DEPTH = 64  # the deepest gpt2port's own files go is 4 (a manifest); tokenizer.json is about 6


def loads(data: bytes | str, where, invalid: str = "not valid JSON") -> object:
    """The JSON value in `data` (read from `where`, which the refusal names, saying `invalid` if it does not parse)."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise GPT2PortError(f"{where}: JSON nested too deeply") from None
    except UnicodeDecodeError as e:
        raise GPT2PortError(f"{where}: not UTF-8 (invalid byte at offset {e.start})") from None
    except ValueError as e:  # JSONDecodeError, and the int() digit limit
        raise GPT2PortError(f"{where}: {invalid} ({' '.join(str(e).split())[:200]})") from None
    if _depth(value) > MAX_DEPTH:
        raise GPT2PortError(f"{where}: JSON nested more than {MAX_DEPTH} deep")
    return value



def _depth(value) -> int:
    """How deeply containers nest in `value`, walked without recursion; stops once past MAX_DEPTH."""
    if not isinstance(value, (dict, list)):
        return 0
    deepest, stack = 1, [(value, 1)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if d > MAX_DEPTH:
            break
        stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, (dict, list)))
    return deepest
