"""The fuzzer's generators for a fine-tuning run's state (scripts/fuzz.py, format "run-state"): a run of the tiny
hostile-files model stopped after its first step is the seed; each case damages one file of its state (meta.json,
rng-0.pt, the DCP .metadata and shard, the token cache, train_log.jsonl) and runs `finetune --resume` on it. A
refusal must be one line naming a file of the run and leave the run exactly as it was; an accepted case finishes
the run; a pickle payload must never run (it would create EXECUTED in the case).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import signal
import types
from pathlib import Path

from scripts.fuzz_mutate import MUTATORS

NAME = "run-state"
MARKER = "EXECUTED"
TARGETS = ("train_state/meta.json", "train_state/rng-0.pt", "train_state/.metadata", "train_state/__0_0.distcp",
           "tokens/train.bin", "tokens/val.bin", "tokens/meta.json", "train_log.jsonl")
HOSTILE = [-5, -1, 0, "3", None, [], {}, [1, 2], 1e308, float("nan"), float("inf"), 2**70, True, "x" * 200, 0.5]
KEYS = ["step", "world", "format", "settings", "settings.steps", "settings.lr", "settings.min_lr", "settings.seed",
        "settings.batch_size", "settings.block_size", "settings.warmup", "settings.grad_accum", "settings.dtype",
        "settings.weight_decay", "settings.val_fraction", "settings.dropout", "settings.clip"]
STEPS = 3
TEXT = ("The fine-tuning fuzzer trains a tiny model on a few plain English sentences, again and again, so that "
        "every token of its small vocabulary is seen. ") * 40


def build(root: Path) -> Path:
    """The seed: root/ckpt (the tiny gpt2port checkpoint), root/text.txt and root/run, a run stopped after step 1
    with its state saved (a stop requested before the first step, as Ctrl-C would)."""
    from scripts import hostile_files
    from gpt2port.training import finetune as ft
    from gpt2port.training import loop

    root.mkdir(parents=True)
    ckpt = hostile_files.build(root / "base", ["gpt2port"])["gpt2port"]
    (root / "text.txt").write_text(TEXT)

    @contextlib.contextmanager
    def requested():
        yield types.SimpleNamespace(caught=[signal.SIGINT])  # as signals.stop_requests records a Ctrl-C

    real, loop.stop_requests = loop.stop_requests, requested
    try:
        ft.finetune(ckpt, root / "text.txt", root / "run", ft.Settings(steps=STEPS, batch_size=2, block_size=4,
                    eval_windows=2, eval_every=0), device="cpu", quiet=True)
    except ft.Interrupted:
        pass
    finally:
        loop.stop_requests = real
    return root / "run"


def commands(case: Path, seed: Path) -> list[list]:
    """`finetune --resume` on a damaged copy (case) of the seed run (seed, as build returned it)."""
    return [["finetune", seed.parent / "base" / "gpt2port", "--data", seed.parent / "text.txt", "--out", case,
             "--resume", "--quiet", "--device", "cpu"]]


def mutate(run: Path, rng: random.Random) -> tuple[str, str, str]:
    """Damage one file of the run at random: (file, kind of damage, what was done)."""
    target = run / rng.choice(TARGETS)
    kind = rng.choices(["bytes", "field", "payload", "delete", "swap", "token id"], [5, 4, 1, 1, 1, 1])[0]
    name = str(target.relative_to(run))
    if kind == "field" and target.name == "meta.json" and target.parent.name == "train_state":
        return name, kind, _field(target, rng)
    if kind == "payload" and target.name in ("rng-0.pt", ".metadata"):
        target.write_bytes(pickle.dumps(_Payload(run / MARKER)))
        return name, kind, "a pickle that runs a shell command"
    if kind == "delete":
        target.unlink()
        return name, kind, "removed"
    if kind == "swap":
        other = run / rng.choice([t for t in TARGETS if run.joinpath(t) != target])
        target.write_bytes(other.read_bytes())
        return name, kind, f"the bytes of {other.relative_to(run)}"
    if kind == "token id" and target.suffix == ".bin":
        data = bytearray(target.read_bytes())
        at = rng.randrange(0, max(1, len(data) // 2)) * 2
        data[at : at + 2] = rng.choice([320, 1000, 65535]).to_bytes(2, "little")
        target.write_bytes(bytes(data))
        return name, kind, f"id at byte {at}"
    kinds = [k for k, (applies, _, _) in MUTATORS.items() if applies(target)]
    k = rng.choices(kinds, [MUTATORS[k][2] for k in kinds])[0]
    return name, k, MUTATORS[k][1](target, rng)


def _field(path: Path, rng: random.Random) -> str:
    meta = json.loads(path.read_text())
    key, value = rng.choice(KEYS), rng.choice(HOSTILE)
    holder, leaf = (meta["settings"], key.split(".")[1]) if key.startswith("settings.") else (meta, key)
    if rng.random() < 0.2:
        holder.pop(leaf, None)
        what = f"{key} removed"
    else:
        holder[leaf] = value
        what = f"{key} = {value!r}"[:80]
    path.write_text(json.dumps(meta))
    return what


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def judge(run: Path, result: dict, before: dict, after: dict) -> str | None:
    """What scripts/fuzz.py's own judge does not see: a payload that ran, a refused run that was changed."""
    if (run / MARKER).exists():
        return "a pickle payload ran"
    if result["rc"] != 0 and after != before:
        return "refused, but the run was changed"
    return None
