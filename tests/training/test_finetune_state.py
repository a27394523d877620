"""finetune --resume reads every file of the run it continues through one validating loader (issue 38, finding 7):
meta.json, rng-R.pt, the DCP metadata and shards, train_log.jsonl and the token cache. Each damaged or hostile
file is refused in one line naming it, nothing is executed, and the run is left exactly as it was."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import shutil
import signal
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt2port import GPT
from gpt2port.checkpoint import read_config, save
from gpt2port.training import loop
from tests.support import ROOT, assert_clean_failure, run_cli, snapshot

LICENSE = Path("/usr/share/common-licenses/GPL-3")
RUN = ["--batch-size", "8", "--block-size", "32", "--eval-every", "0", "--eval-windows", "4", "--quiet"]


@pytest.fixture(scope="module")
def stopped(tiny_ckpt, tmp_path_factory) -> tuple[Path, Path]:
    """(a run stopped after its first step with its state saved, its data): a stop requested before the run began
    (as Ctrl-C would) makes it save at step 1 and exit 130."""
    base = tmp_path_factory.mktemp("stopped")
    data = base / "text.txt"
    shutil.copy(LICENSE if LICENSE.is_file() else ROOT / "README.md", data)

    @contextlib.contextmanager
    def requested():
        yield types.SimpleNamespace(caught=[signal.SIGINT])  # as signals.stop_requests records a Ctrl-C

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "stop_requests", requested)
        r = run_cli("finetune", tiny_ckpt, "--data", data, "--out", base / "run", "--steps", "4", *RUN)
    assert r.exit_code == 130, r.output
    assert json.loads((base / "run" / "train_state" / "meta.json").read_text())["step"] == 1
    return base / "run", data


class Payload:
    """A pickle that, if unpickled by an unrestricted loader, creates the file `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _edit_meta(run: Path, change) -> None:
    path = run / "train_state" / "meta.json"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


def _retoken(run: Path, change) -> None:
    path = run / "tokens" / "train.bin"
    ids = np.fromfile(path, dtype=np.uint16)
    change(ids, path)


CASES = {
    "step -5": ("meta.json", lambda run: _edit_meta(run, lambda m: m.update(step=-5))),
    "step '3'": ("meta.json", lambda run: _edit_meta(run, lambda m: m.update(step="3"))),
    "no settings": ("meta.json", lambda run: _edit_meta(run, lambda m: m.pop("settings"))),
    "settings a list": ("meta.json", lambda run: _edit_meta(run, lambda m: m.update(settings=[1, 2]))),
    "a setting missing": ("meta.json", lambda run: _edit_meta(run, lambda m: m["settings"].pop("seed"))),
    "a NaN setting": ("meta.json", lambda run: _edit_meta(run, lambda m: m["settings"].update(lr=float("nan")))),
    "world 0": ("meta.json", lambda run: _edit_meta(run, lambda m: m.update(world=0))),
    "rng garbage": ("rng-0.pt", lambda run: (run / "train_state" / "rng-0.pt").write_bytes(os.urandom(700))),
    "rng missing": ("rng-0.pt", lambda run: (run / "train_state" / "rng-0.pt").unlink()),
    "rng a pickle payload": ("rng-0.pt", lambda run: (run / "train_state" / "rng-0.pt").write_bytes(
        pickle.dumps(Payload(run.parent / "executed")))),
    "rng of the wrong shape": ("rng-0.pt", lambda run: torch.save({"cpu": torch.zeros(3, dtype=torch.uint8)},
                                                                  run / "train_state" / "rng-0.pt")),
    "shard truncated": ("__0_0.distcp", lambda run: os.truncate(run / "train_state" / "__0_0.distcp", 100_000)),
    "shard missing": ("__0_0.distcp", lambda run: (run / "train_state" / "__0_0.distcp").unlink()),
    "shard garbage": ("train_state", lambda run: _overwrite(run / "train_state" / "__0_0.distcp", b"x" * 4096)),
    "metadata garbage": (".metadata", lambda run: (run / "train_state" / ".metadata").write_bytes(os.urandom(3000))),
    "metadata a pickle payload": (".metadata", lambda run: (run / "train_state" / ".metadata").write_bytes(
        pickle.dumps(Payload(run.parent / "executed")))),
    "log binary": ("train_log.jsonl", lambda run: (run / "train_log.jsonl").write_bytes(os.urandom(2000) + b"\n")),
    "log not rows": ("train_log.jsonl", lambda run: (run / "train_log.jsonl").write_text('[1, 2]\n{"step": "x"}\n')),
    "tokens truncated": ("train.bin", lambda run: os.truncate(run / "tokens" / "train.bin", 1000)),
    "tokens out of range": ("train.bin", lambda run: _retoken(run, lambda ids, p: (ids.__setitem__(7, 60000),
                                                                                  ids.tofile(p)))),
    "tokens meta lies": ("tokens/meta.json", lambda run: _edit_tokens_meta(run)),  # its sealed record says so
}


def _overwrite(path: Path, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.write(data)


def _edit_tokens_meta(run: Path) -> None:
    path = run / "tokens" / "meta.json"
    meta = json.loads(path.read_text())
    meta["n_train"] += 1000
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_state_is_refused_naming_the_file_and_the_run_is_left_as_it_was(case, stopped, tiny_ckpt,
                                                                                   tmp_path):
    named, damage = CASES[case]
    run, data = tmp_path / "run", stopped[1]
    shutil.copytree(stopped[0], run, symlinks=True)
    damage(run)
    before = snapshot(tmp_path)
    r = run_cli("finetune", tiny_ckpt, "--data", data, "--out", run, "--resume", "--quiet")
    line = assert_clean_failure(r, names=[run])
    assert named in line and "internal error" not in line, line
    assert snapshot(tmp_path) == before  # nothing executed (no marker file), nothing written
    assert "weights_only=False" not in line and "weights_only` set to `False" not in line


def test_a_run_of_a_model_of_another_shape_is_refused_before_loading(stopped, tiny_ckpt, tmp_path):
    config = read_config(tiny_ckpt)
    wider = save(GPT(dataclasses.replace(config, n_layer=config.n_layer + 1)), tmp_path / "deeper",
                 tokenizer_from=tiny_ckpt)
    run = tmp_path / "run"
    shutil.copytree(stopped[0], run)
    before = snapshot(run)
    r = run_cli("finetune", wider, "--data", stopped[1], "--out", run, "--resume", "--quiet")
    line = assert_clean_failure(r, names=[run / "train_state" / ".metadata"])
    assert "another model" in line, line
    assert snapshot(run) == before


def test_the_stopped_run_itself_resumes(stopped, tiny_ckpt, tmp_path):
    """The fixture's state is sound: what the other tests damage is the only difference."""
    run = tmp_path / "run"
    shutil.copytree(stopped[0], run)
    r = run_cli("finetune", tiny_ckpt, "--data", stopped[1], "--out", run, "--resume", "--quiet")
    assert r.exit_code == 0, r.output
    assert [json.loads(x)["step"] for x in (run / "train_log.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert all(bool(torch.isfinite(p).all()) for p in GPT.from_pretrained(run).parameters())


def test_a_state_saved_before_lora_existed_resumes(stopped, tiny_ckpt, tmp_path):
    """A run stopped by the previous version (its meta.json has no lora_* settings) resumes as a full fine-tune."""
    run = tmp_path / "run"
    shutil.copytree(stopped[0], run)
    _edit_meta(run, lambda meta: [meta["settings"].pop(k) for k in list(meta["settings"]) if k.startswith("lora")])
    settings = json.loads((run / "train_state" / "meta.json").read_text())["settings"]
    assert not any(k.startswith("lora") for k in settings)
    r = run_cli("finetune", tiny_ckpt, "--data", stopped[1], "--out", run, "--resume", "--quiet")
    assert r.exit_code == 0, r.output
    assert [json.loads(x)["step"] for x in (run / "train_log.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
