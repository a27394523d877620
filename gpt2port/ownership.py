"""What gpt2port may remove: the one rule for `--force` and for the sweeps of its own build directories.

A directory is gpt2port's only if every entry in it, at every depth, is something a gpt2port writer makes, of the
kind it makes (a regular file where gpt2port writes a file, a directory where it writes one; never a link, FIFO,
socket or device), and is claimed by a mark that checks out against what it describes, by content (records.py):

- a sealed record claims the files it lists, each under a name its output's writer gives it, only while its content
  is what was recorded: manifest.json ("tool": "gpt2port"; a checkpoint's or an export's files, a run's adapter/),
  a run's tokens/meta.json (train.bin, val.bin), a run's train_log.record.json (its log and chart);
- a fine-tuning run's train_state/meta.json claims the state (torch's DCP files) when there is an rng file for every
  rank of its world and DCP's .metadata; a record or a state makes the directory a run, which claims the run's own
  directories (the state being saved, the checkpoint being moved in);
- a build directory (.NAME.partial-PID) carries the stage mark written first into it, naming it; a checkpoint moved
  aside (.NAME.replaced-PID) is checked as any output.

The marks of versions that recorded no fingerprints (a manifest of sizes, a checkpoint's config.json, a token
cache's counts, an hf config.json or a GGUF of gpt2port's without a manifest) claim nothing here: check_replaceable
names such an output as an earlier version's, and accepts it only where asked (finetune --resume).

Entries are looked at with lstat only: nothing is followed and nothing is opened but the small JSON marks, a GGUF's
first 4 KB and files whose identity moved since they were recorded, and those only once lstat says they are
regular files (a FIFO is never opened).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import stat
from pathlib import Path

from gpt2port import records
from gpt2port.errors import GPT2PortError
from gpt2port.filekind import kind
from gpt2port.records import RUN_RECORD, RUN_RECORD_NEW
from gpt2port.registry import ADAPTER_DIR, ADAPTER_FILES, OTHER_OUTPUTS, REGISTRY, TOKENIZER

PARTIAL_MARK = ".partial-"  # temporary build directories: .<name>.partial-<pid>
OLD_MARK = ".replaced-"  # a checkpoint being replaced, kept until the new one is in place
STAGE_MARK = ".gpt2port-stage.json"  # written first into every build directory: {"tool": "gpt2port", "stage": NAME}
LEFTOVER = re.compile(r"\.(.+)(\.partial|\.replaced)-(\d+)")
MANIFEST, CONFIG, WEIGHTS = "manifest.json", "config.json", "model.safetensors"
# A fine-tuning run directory's own entries (training/: finetune.py, data.py, state.py).
RUN_FILES = ("train_log.jsonl", "loss.svg", "loss.png")  # loss.png: the chart before it became loss.svg
TOKENS, TOKENS_FILES = "tokens", ("train.bin", "val.bin", "meta.json", STAGE_MARK)
STATES, STATE_SAVING, STATE_FILE = ("train_state", ".train_state.old"), ".train_state.partial", \
    re.compile(r"meta\.json|\.metadata|__\d+_\d+\.distcp|rng-\d+\.pt")
RUN_CHECKPOINT = ".checkpoint"  # the fine-tuned checkpoint, written whole, then moved into the run file by file
SCRATCH = ".gpt2port-"  # the prefix of the scratch directories made inside a build directory (fsio.scratch_directory)
# Every name gpt2port gives a file in an output, a build directory or a run (shell patterns).
_FILE_NAMES = (*(p for t in REGISTRY.values() for p in t.files), *(p for f in OTHER_OUTPUTS.values() for p in f),
               *RUN_FILES, *TOKENS_FILES)
_TAG_LIMIT = 64 << 20  # bytes: far above any manifest or meta.json gpt2port writes
def check_replaceable(dest: Path, earlier: bool = False) -> None:
    """Refuse, in one line naming the first entries at fault, to replace a directory that is not gpt2port's as
    gpt2port wrote it. An output of a version that recorded no fingerprints is refused in a line of its own, or
    accepted with `earlier` (finetune --resume of a run it began)."""
    dest = Path(dest)
    if os.path.islink(dest):
        raise GPT2PortError(f"{dest}: is a symbolic link (to {os.readlink(dest)}); gpt2port replaces a directory "
                            f"only by its own path: give that as --out")
    foreign = output_problems(dest)
    if foreign and not output_problems(dest, earlier=True):
        if earlier:
            return
        raise GPT2PortError(f"{dest}: written by an earlier version of gpt2port, which kept no fingerprint of the "
                            f"files it wrote, so --force cannot tell whether they were changed since (it still "
                            f"loads); choose another --out or remove it yourself")
    if foreign:
        shown = ", ".join(foreign[:4]) + (", …" if len(foreign) > 4 else "")
        raise GPT2PortError(f"{dest}: holds files gpt2port did not write ({shown}); choose another "
                            f"--out or remove it yourself")


def is_ours(leftover: Path) -> bool:
    """Whether a .NAME.partial-PID or .NAME.replaced-PID directory is gpt2port's, its whole tree (see the module)."""
    return kind(leftover) == "directory" and not _leftover(leftover, "", nested=False)


def output_problems(d: Path, rel: str = "", earlier: bool = False) -> list[str]:
    """The entries of output directory `d` (at every depth) that are not gpt2port's as it wrote them, as paths
    relative to the directory checked, with why when the name alone does not say; [] when all are. earlier: the
    marks of versions that recorded no fingerprints claim what they claimed then (names and sizes)."""
    entries = _list(d)
    claims: dict[str, object] = {}  # name -> None (a file) or a checker for a directory: (path, rel) -> problems
    problems: dict[str, str] = {}
    manifest = _json(d, MANIFEST, entries) or {}
    run = False
    if records.is_mark(manifest) and _manifest_ours(manifest):
        if _recorded(d, rel, MANIFEST, manifest, _recordable(manifest), entries, claims, problems):
            run = _finetuned(manifest)
    elif earlier:
        run = _claim_earlier(d, rel, entries, manifest, claims, problems)
    run_record = _json(d, RUN_RECORD, entries) or {}
    if records.is_mark(run_record):
        run = _recorded(d, rel, RUN_RECORD, run_record, RUN_FILES, entries, claims, problems) or run
    if entries.get(TOKENS) == "directory":
        unclaimed = _tokens_unclaimed(d / TOKENS, earlier)
        if unclaimed is None:
            claims[TOKENS], run = _tokens_dir, True
        elif unclaimed:  # marked as gpt2port's, but the mark does not describe the files: say which
            problems[TOKENS] = f"{rel}{TOKENS}/{unclaimed}"
    for name in STATES:
        if entries.get(name) == "directory":
            why = _state_unclaimed(d / name)
            if why is None:
                claims[name], run = _state_dir, True
            elif why:  # marked as a state of ours, but incomplete or its meta.json damaged: say which file
                problems[name] = f"{rel}{name}/{why}"
    if run:
        claims[STATE_SAVING], claims[RUN_CHECKPOINT], claims[RUN_RECORD_NEW] = _state_dir, _checkpoint_dir, None
        moving = _json(d / RUN_CHECKPOINT, MANIFEST, _list(d / RUN_CHECKPOINT)) \
            if entries.get(RUN_CHECKPOINT) == "directory" else None
        if moving and records.files_of(moving) is not None:  # a finish killed while it moved the files in
            _claim(d, rel, entries, records.files_of(moving), _recordable(moving), claims, problems)
        if earlier:
            claims.update((n, None) for n in RUN_FILES if n not in claims)
            claims.setdefault(ADAPTER_DIR, _adapter_dir)
    for name, what in sorted(entries.items()):
        if name in problems:
            continue
        m = LEFTOVER.fullmatch(name)
        if name not in claims and m and what == "directory":
            problems.update((p, p) for p in _leftover(d / name, f"{rel}{name}/", nested=bool(rel)))
        elif name not in claims:
            problems[name] = _foreign(rel, name, what)
        elif claims[name] is None and what != "file":
            problems[name] = f"{rel}{name} (a {what}, where gpt2port writes a file)"
        elif claims[name] is not None and what != "directory":
            problems[name] = f"{rel}{name} (a {what}, where gpt2port writes a directory)"
        elif claims[name] is not None:
            problems.update((p, p) for p in claims[name](d / name, f"{rel}{name}/"))
    return [problems[name] for name in sorted(problems)]  # in the order of the names, however found


def _recorded(d: Path, rel: str, name: str, mark: dict, allowed, entries, claims, problems) -> bool:
    """Claim the mark `name` and the files it records, each only as gpt2port wrote it; False (and the mark named)
    when the mark itself was changed since it was sealed."""
    files = records.files_of(mark)
    if files is None:
        problems[name] = f"{rel}{name} (changed since gpt2port wrote it)"
        return False
    claims[name] = None
    _claim(d, rel, entries, files, allowed, claims, problems)
    return True


def _claim(d: Path, rel: str, entries, files: dict, allowed, claims, problems) -> None:
    """Claim each entry of `d` that `files` records (under a name `allowed`) and that is still what was recorded;
    a recorded file changed since is a problem named with why. One level down: a run's adapter/."""
    below: dict[str, dict] = {}
    for path, rec in files.items():
        name, _, rest = path.partition("/")
        if rest:
            if name == ADAPTER_DIR and ADAPTER_DIR in allowed and rest in ADAPTER_FILES:
                below.setdefault(name, {})[rest] = rec
        elif _matches(name, allowed) and entries.get(name) == "file" and name not in claims:
            why = records.changed(d / name, rec)  # absent, or not a file: nothing to lose, or judged as any other
            if why:
                problems[name] = f"{rel}{name} ({why})"
            else:
                claims[name] = None
    for name, recs in below.items():
        if entries.get(name) == "directory":
            claims[name] = _recorded_dir(recs)


def _recorded_dir(recs: dict[str, dict]):
    """The checker of a directory whose files a record lists ({name: record}): each recorded and unchanged."""
    def check(d: Path, rel: str) -> list[str]:
        out = []
        for name, what in sorted(_list(d).items()):
            if name not in recs or what != "file":
                out += _names_of(d, rel, name, what, tuple(recs))
            elif why := records.changed(d / name, recs[name]):
                out.append(f"{rel}{name} ({why})")
        return out
    return check


def _recordable(manifest: dict) -> tuple[str, ...]:
    """The names a manifest may record: its layout's files, and a fine-tuning run's adapter/."""
    return (*_layout_files(manifest.get("layout", "gpt2port")), ADAPTER_DIR)


def _claim_earlier(d: Path, rel: str, entries, manifest: dict, claims, problems) -> bool:
    """What the marks of a version that recorded no fingerprints claim (names, and sizes where it recorded them);
    whether they make `d` a run."""
    config = _json(d, CONFIG, entries) or {}
    checkpoint = run = False
    listed = _manifest_files(manifest)
    if listed is not None:
        files = _layout_files(manifest.get("layout", "gpt2port"))
        claims[MANIFEST] = None
        for name, size in listed.items():
            if entries.get(name) != "file" or not _matches(name, files):
                continue  # absent (nothing to lose), or judged below as any other entry
            actual = os.lstat(d / name).st_size
            if actual == size:
                claims[name] = None
            else:
                problems[name] = f"{rel}{name} ({actual:,} bytes; {MANIFEST} records {size:,})"
        run = _finetuned(manifest)
    if config.get("format") == "gpt2port" and listed is not None:  # a checkpoint (every version wrote a manifest;
        checkpoint = True  # the tokenizer files are listed nowhere: claimed by name)
        claims[CONFIG] = None
        if listed is None or WEIGHTS not in listed:
            claims[WEIGHTS] = None
    if checkpoint:
        claims.update((n, None) for n in _tokenizer_names())
    if listed is None and not checkpoint:
        claims.update((n, None) for n in _old_export(d, entries, config))
    return run


# --- the parts of an output ------------------------------------------------------------------------------------------

def _names(d: Path, rel: str, allowed) -> list[str]:
    """Problems of a directory that may hold only regular files whose names pass allowed(name)."""
    out = []
    for name, what in sorted(_list(d).items()):
        if not allowed(name):
            out.append(_foreign(rel, name, what))
        elif what != "file":
            out.append(f"{rel}{name} (a {what}, where gpt2port writes a file)")
    return out


def _adapter_dir(d: Path, rel: str) -> list[str]:
    return _names(d, rel, lambda n: n in ADAPTER_FILES)


def _layout_files(layout: str) -> tuple[str, ...]:
    return REGISTRY[layout].files if layout in REGISTRY else OTHER_OUTPUTS[layout]


def _tokens_dir(d: Path, rel: str) -> list[str]:
    return _names(d, rel, lambda n: n in TOKENS_FILES)


def _state_dir(d: Path, rel: str) -> list[str]:
    return _names(d, rel, STATE_FILE.fullmatch)


def _checkpoint_dir(d: Path, rel: str) -> list[str]:
    """A run's .checkpoint: a checkpoint, or what is left of one while its files move into the run."""
    return _names(d, rel, lambda n: _matches(n, REGISTRY["gpt2port"].files))


def _stage_dir(d: Path, rel: str) -> list[str]:
    """A build directory's contents: any file an output holds, and the scratch directories of tokenizer files."""
    out = []
    for name, what in sorted(_list(d).items()):
        if name.startswith(SCRATCH) and what == "directory":
            out += _names(d / name, f"{rel}{name}/", lambda n: n in _tokenizer_names())
        elif name != STAGE_MARK or what != "file":
            out += _names_of(d, rel, name, what, _FILE_NAMES)
    return out


def _names_of(d: Path, rel: str, name: str, what: str, patterns) -> list[str]:
    if not _matches(name, patterns):
        return [_foreign(rel, name, what)]
    return [] if what == "file" else [f"{rel}{name} (a {what}, where gpt2port writes a file)"]


def _foreign(rel: str, name: str, what: str) -> str:
    """How an entry no mark claims is named in the refusal: its path, and its kind when that is what is wrong."""
    if what == "file" or (what == "directory" and not _matches(name, _FILE_NAMES)):
        return rel + name
    return f"{rel}{name} (a {what}" + (", where gpt2port writes a file)" if _matches(name, _FILE_NAMES) else ")")


def _leftover(d: Path, rel: str, nested: bool) -> list[str]:
    """Problems of a .NAME.partial-PID / .NAME.replaced-PID directory; the whole of it when it carries no mark."""
    whole = [rel.rstrip("/")]
    m = LEFTOVER.fullmatch(d.name)
    if m is None:
        return whole
    entries = _list(d)
    if m.group(2) == ".partial" and STAGE_MARK in entries:
        mark = _json(d, STAGE_MARK, entries) or {}
        return _stage_dir(d, rel) if mark.get("tool") == "gpt2port" and mark.get("stage") == d.name else whole
    if nested or not entries:  # an output moved aside holds no outputs moved aside
        return whole
    # A moved-aside output, or a finished build directory (its stage mark is removed just before the renames that
    # put it in place, and a kill may fall between them): checked as any output.
    return whole if output_problems(d, rel) else []


# --- marks, checked against what they describe ----------------------------------------------------------------------

def _manifest_files(manifest: dict) -> dict[str, int] | None:
    """What a gpt2port manifest.json records, {name: size}; None when it is not one ({} when it records nothing)."""
    if not _manifest_ours(manifest):
        return None
    files = manifest.get("files", {})
    if not isinstance(files, dict) or not all(type(v) is int and v >= 0 for v in files.values()):
        return None
    return files


def _manifest_ours(manifest: dict) -> bool:
    layout = manifest.get("layout", "gpt2port")
    return manifest.get("tool") == "gpt2port" and isinstance(layout, str) and layout in {*REGISTRY, *OTHER_OUTPUTS}


def _finetuned(manifest: dict) -> bool:
    """Whether a checkpoint's manifest records a fine-tuning run (which leaves its log, chart and tokens beside)."""
    saves = manifest.get("saves")
    last = saves[-1] if isinstance(saves, list) and saves else manifest.get("source")
    return isinstance(last, dict) and "finetune" in last


def _tokens_unclaimed(d: Path, earlier: bool = False) -> str | None:
    """None when a run's tokens/ is gpt2port's (meta.json names the format and records the token files as they are;
    with `earlier`, a meta.json without a record whose counts give the files' sizes); else why not: "" where there
    is no mark (or not one gpt2port writes), the file and why where the mark does not describe the files."""
    entries = _list(d)
    meta = _json(d, "meta.json", entries) or {}
    if not str(meta.get("format", "")).startswith("gpt2port-tokens/"):
        return ""
    if records.is_mark(meta):
        files = records.files_of(meta)
        if files is None or not {"train.bin", "val.bin"} <= set(files):
            return "meta.json (changed since gpt2port wrote it)"
        for f in ("train.bin", "val.bin"):
            if entries.get(f) != "file":
                return f"{f} (missing or not a file)"
            if why := records.changed(d / f, files[f]):
                return f"{f} ({why})"
        return None
    if not earlier:
        return ""
    width = {"uint16": 2, "uint32": 4}.get(meta.get("dtype"))
    counts = meta.get("n_train"), meta.get("n_val")
    if width is None or not all(type(n) is int and n >= 0 for n in counts):
        return ""
    for f, n in zip(("train.bin", "val.bin"), counts):
        if entries.get(f) != "file":
            return f"{f} (missing or not a file; meta.json counts {n:,} tokens)"
        if (size := os.lstat(d / f).st_size) != n * width:
            return f"{f} ({size:,} bytes; meta.json gives {n * width:,})"
    return None


def _state_unclaimed(d: Path) -> str | None:
    """A run's saved state: meta.json names the format and its world; an rng file per rank, DCP's metadata. None
    when it is one; else the file at fault, with why ("" when nothing marks the directory as a state at all)."""
    entries = _list(d)
    meta = _json(d, "meta.json", entries) or {}
    if not str(meta.get("format", "")).startswith("gpt2port-train-state/"):
        return ""
    world = meta.get("world")
    if type(world) is not int or not 1 <= world <= len(entries):
        return f"meta.json (its world, {json.dumps(world)[:40]}, is not a count of the ranks it saved)"
    missing = [n for n in (".metadata", *(f"rng-{r}.pt" for r in range(world))) if entries.get(n) != "file"]
    return f"{missing[0]} (missing, or not a file)" if missing else None


def _old_export(d: Path, entries: dict[str, str], config: dict) -> list[str]:
    """The files of an export by a version that wrote no manifest, told by its own marks: an hf export's config.json
    (gpt2port adds "dtype", transformers always writes "transformers_version"), or a GGUF that gpt2port named
    "GPT-2". llm.c's files are not among them: gpt2port writes them byte for byte as llm.c's own train_gpt2.py
    does, so a directory of them may be the user's."""
    if entries == {"model.gguf": "file"}:
        head = _head(d / "model.gguf", 4096)
        ours = head.startswith(b"GGUF") and b"general.name\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00GPT-2" in head
        return ["model.gguf"] if ours else []
    if entries.get(WEIGHTS) == "file" and config.get("model_type") == "gpt2" and "dtype" in config \
            and "transformers_version" not in config:
        return [WEIGHTS, CONFIG, *_tokenizer_names()]
    return []


# --- looking without opening what could block -----------------------------------------------------------------------

def _list(d: Path) -> dict[str, str]:
    try:
        with os.scandir(d) as it:
            return {e.name: kind(Path(e.path)) or "file" for e in it}
    except OSError as e:
        raise GPT2PortError(f"{d}: cannot list it: {e.strerror or e}") from None


def _json(d: Path, name: str, entries: dict[str, str]) -> dict | None:
    """A small JSON object at d/name, read only once lstat says it is a regular file."""
    if entries.get(name) != "file":
        return None
    try:
        if os.lstat(d / name).st_size > _TAG_LIMIT:
            return None
        data = json.loads(_head(d / name, _TAG_LIMIT))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _head(path: Path, n: int) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return b""
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        return f.read(n)


def _matches(name: str, patterns) -> bool:
    names = [p for p in patterns if p != TOKENIZER]
    return any(fnmatch.fnmatchcase(name, p) for p in names) or (TOKENIZER in patterns and name in _tokenizer_names())


def _tokenizer_names() -> tuple[str, ...]:
    from gpt2port.tokenizer import TOKENIZER_FILES  # here: tokenizer imports tiktoken, not needed to list files

    return TOKENIZER_FILES
