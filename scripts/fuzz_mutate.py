"""The mutations of scripts/fuzz.py: each takes a file and a random.Random, changes the file in place, and says what
it did. MUTATORS: name -> (applies to this file?, mutate). Byte-level ones aim most of their hits at the file's
structured head (a safetensors header, GGUF metadata and tensor infos, llm.c's 1 KB header), where a wrong byte is
interesting; tensor bytes are mostly just numbers."""

from __future__ import annotations

import io
import json
import random
import struct
import zipfile
from pathlib import Path

HUGE = [2**31 - 1, 2**32 - 1, 2**62, 2**63 - 1, 2**64 - 1, 10**9, 10**12, 0, 1, 2**63]  # 2**63: -2**63 signed
JSON_VALUES = ["0", "-4", "2.5", "1e308", "-1e308", "NaN", "Infinity", "-Infinity", "9" * 5000, '"12"', '""', "true",
               "null", "[]", "{}", "[" * 100_000 + "]" * 100_000, '"' + "x" * 1_000_000 + '"', str(2**63), str(2**64),
               str(-(2**63)), "1000000000", '{"a": ' * 500 + "1" + "}" * 500]
PLACEHOLDER = "\x00fuzz\x00"


def is_binary(path: Path) -> bool:
    return path.suffix not in (".json",)


def hot_range(path: Path, data: bytes) -> tuple[int, int]:
    """Where the structure is: the span of `data` a byte-level mutation mostly aims at."""
    if path.suffix == ".safetensors" and len(data) >= 8:
        return 0, min(len(data), 8 + struct.unpack_from("<Q", data)[0])
    if path.suffix == ".gguf":
        return 0, gguf_counts(data)[1] or len(data)
    if path.name.startswith("gpt2_") and path.suffix == ".bin":
        return 0, min(len(data), 1024)
    return 0, len(data)


def _position(path: Path, data: bytes, rng: random.Random) -> int:
    lo, hi = hot_range(path, data) if rng.random() < 0.8 else (0, len(data))
    return rng.randrange(lo, max(lo + 1, hi))


# --- byte-level -------------------------------------------------------------------------------------------------------

def truncate(path: Path, rng: random.Random) -> str:
    data = path.read_bytes()
    at = _position(path, data, rng)
    path.write_bytes(data[:at])
    return f"cut at byte {at} of {len(data)}"


def bit_flips(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    bits = [(_position(path, data, rng), rng.randrange(8)) for _ in range(rng.randint(1, 4))]
    for at, bit in bits:
        if at < len(data):
            data[at] ^= 1 << bit
    path.write_bytes(bytes(data))
    return "bits " + ", ".join(f"{at}.{bit}" for at, bit in bits)


def huge_int(path: Path, rng: random.Random) -> str:
    """A count-sized word overwritten with a huge, zero or negative value: at a GGUF's own count and length fields,
    elsewhere at an aligned offset in the structured head."""
    data = bytearray(path.read_bytes())
    counts = gguf_counts(bytes(data))[0] if path.suffix == ".gguf" else []
    if counts and rng.random() < 0.8:
        at, size = rng.choice(counts)
    else:
        size = rng.choice((4, 8))
        at = _position(path, data, rng) // size * size
    value = rng.choice(HUGE) % (1 << (8 * size))
    data[at : at + size] = value.to_bytes(size, "little")
    path.write_bytes(bytes(data))
    return f"{size}-byte word at {at} := {value}"


def insert_or_delete(path: Path, rng: random.Random) -> str:
    data = path.read_bytes()
    at, n = _position(path, data, rng), rng.randint(1, 16)
    if rng.random() < 0.5:
        path.write_bytes(data[:at] + rng.randbytes(n) + data[at:])
        return f"{n} random bytes inserted at {at}"
    path.write_bytes(data[:at] + data[at + n :])
    return f"{n} bytes deleted at {at}"


def append(path: Path, rng: random.Random) -> str:
    data = path.read_bytes()
    extra = rng.randbytes(rng.randint(1, 256)) if rng.random() < 0.5 else data[: rng.randint(8, 512)]
    path.write_bytes(data + extra)
    return f"{len(extra)} bytes appended"


# --- JSON -------------------------------------------------------------------------------------------------------------

def _paths(value, prefix=()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:8]):
            out += _paths(v, prefix + (i,))
    return out


def hostile_json(value, rng: random.Random) -> tuple[str, str]:
    """`value` re-serialised with one hostile value (raw JSON text) at a random place, or one key deleted."""
    paths = _paths(value)
    where = rng.choice(paths[1:] or paths)
    raw = rng.choice(JSON_VALUES)
    if not where:
        return raw, f"whole value := {raw[:20]}"
    parent = value
    for k in where[:-1]:
        parent = parent[k]
    if isinstance(parent, dict) and rng.random() < 0.2:
        del parent[where[-1]]
        return json.dumps(value), f"{'.'.join(map(str, where))} deleted"
    parent[where[-1]] = PLACEHOLDER
    text = json.dumps(value).replace(json.dumps(PLACEHOLDER), raw)
    return text, f"{'.'.join(map(str, where))} := {raw[:20]}{'...' if len(raw) > 20 else ''}"


def json_value(path: Path, rng: random.Random) -> str:
    text, what = hostile_json(json.loads(path.read_text()), rng)
    path.write_text(text)
    return what


def safetensors_header(path: Path, rng: random.Random) -> str:
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data)
    text, what = hostile_json(json.loads(data[8 : 8 + n]), rng)
    raw = text.encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    return f"header {what}"


# --- structured: TF index entries, GGUF counts, pickle members --------------------------------------------------------

def tf_entry(path: Path, rng: random.Random) -> str:
    """One entry (or the header) of a TF index re-encoded with a hostile field, checksums made valid again."""
    from gpt2port.formats.tf_bundle import _fields, read_table
    from scripts.hostile_files import proto, write_sstable

    table = read_table(path)
    key = rng.choice(sorted(table))
    fields = [(n, 2 if isinstance(v, bytes) else 0, v) for n, v in _fields(table[key])]
    number = rng.choice([n for n, _, _ in fields] + [1, 2, 3, 5, 7])
    how = rng.choice(["huge", "bytes", "drop", "wire", "dim"])
    if how == "huge":
        fields = [f for f in fields if f[0] != number] + [(number, 0, rng.choice(HUGE))]
    elif how == "bytes":
        fields = [f for f in fields if f[0] != number] + [(number, 2, rng.randbytes(rng.randint(0, 40)))]
    elif how == "drop":
        fields = [f for f in fields if f[0] != number]
    elif how == "dim":  # a dimension of the shape: huge, negative, or stored as bytes
        d = rng.choice([proto((1, 0, rng.choice(HUGE))), proto((1, 2, b"\x01" * rng.randint(1, 2000)))])
        fields = [f for f in fields if f[0] != 2] + [(2, 2, proto((2, 2, d)))]
    encoded = proto(*fields)
    if how == "wire":
        encoded += bytes([number << 3 | rng.choice((3, 4, 6, 7))]) + rng.randbytes(4)
    table[key] = encoded
    write_sstable(path, table)
    return f"entry {key.decode(errors='replace')!r} field {number}: {how}"


def gguf_counts(data: bytes) -> tuple[list[tuple[int, int]], int]:
    """(position, size) of every count and length of a well-formed GGUF, and where its tensor data starts (0 if the
    file cannot be walked)."""
    out, pos = [], 24
    try:
        n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
        out += [(8, 8), (16, 8)]

        def string() -> None:
            nonlocal pos
            out.append((pos, 8))
            pos += 8 + struct.unpack_from("<Q", data, pos)[0]

        def value(kind: int) -> None:
            nonlocal pos
            fixed = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
            if kind in fixed:
                pos += fixed[kind]
            elif kind == 8:
                string()
            else:
                item, n = struct.unpack_from("<IQ", data, pos)
                out.append((pos + 4, 8))
                pos += 12
                for _ in range(n):
                    value(item)
        for _ in range(n_kv):
            string()
            kind = struct.unpack_from("<I", data, pos)[0]
            pos += 4
            value(kind)
        for _ in range(n_tensors):
            string()
            (dims,) = struct.unpack_from("<I", data, pos)
            out.append((pos, 4))
            out += [(pos + 4 + 8 * i, 8) for i in range(dims)]
            out.append((pos + 4 + 8 * dims + 4, 8))  # the data offset
            pos += 4 + 8 * dims + 12
        return out, pos + (-pos % 32)
    except (struct.error, RecursionError):
        return out, 0


def zip_member(path: Path, rng: random.Random) -> str:
    """One member of a zip pickle (data.pkl, a storage, the version record) damaged, the archive itself valid."""
    with zipfile.ZipFile(path) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    name = rng.choice(sorted(members))
    data = bytearray(members[name])
    how = rng.choice(["flip", "cut", "huge"])
    if how == "flip" and data:
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif how == "cut":
        data = data[: rng.randrange(len(data) + 1)]
    elif len(data) >= 8:
        at = rng.randrange(len(data) - 7)
        data[at : at + 8] = (rng.choice(HUGE) % 2**64).to_bytes(8, "little")
    members[name] = bytes(data)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for k, v in members.items():
            z.writestr(k, v)
    path.write_bytes(buf.getvalue())
    return f"zip member {name}: {how}"


# name -> (applies to this file?, mutate, weight)
MUTATORS = {
    "truncate": (lambda p: True, truncate, 1),
    "bit flips": (is_binary, bit_flips, 1),
    "huge int": (is_binary, huge_int, 1),
    "insert/delete": (lambda p: True, insert_or_delete, 1),
    "append": (is_binary, append, 1),
    "json value": (lambda p: p.suffix == ".json", json_value, 3),
    "safetensors header": (lambda p: p.suffix == ".safetensors", safetensors_header, 1),
    "tf entry": (lambda p: p.suffix == ".index", tf_entry, 3),
    "zip member": (lambda p: p.suffix in (".bin", ".pt") and zipfile.is_zipfile(p), zip_member, 2),
}
