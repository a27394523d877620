"""Faults in the middle of a conversion never cost a user their data (bad inputs are in test_safety.py).

Disk full, Ctrl-C, SIGKILL (also between the two renames of a --force replacement), a failed post-write check and
two conversions racing for one destination. After each: the final name holds either nothing, the previous
checkpoint byte for byte, or one complete checked checkpoint; never a mix. Temporary directories are gone, or (after
SIGKILL, when nothing can clean up) swept by the next run. The source is never touched.

Faults are injected into a real `gpt2port` process by FAULTS below, a wrapper around the CLI that patches the
safetensors writer and fsio per $GPT2PORT_TEST_FAULT; disk full is also produced for real on a small tmpfs when we may
mount one.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpt2port.formats.safetensors as safetensors_mod
import gpt2port.fsio as fsio_mod
import gpt2port.outfile as outfile_mod
from gpt2port.errors import GPT2PortError
from gpt2port.fsio import PARTIAL_MARK, staged_directory, sweep_leftovers, write_file, write_mark
from scripts import fake_hub, fill_fake_hub
from tests.support import (WEIGHTS, assert_clean_failure, assert_one_line_error, assert_valid_checkpoint,
                           interruptible, leftovers, run_cli, snapshot)
from tests.support import ROOT

# The CLI with faults patched in, chosen by the JSON in $GPT2PORT_TEST_FAULT:
#   slow: seconds to sleep before each tensor (and touch `started` at the first), so a signal lands mid-write
#   go: at the first tensor, after touching `started`, wait until this file exists (lines two runs up for a race)
#   signal_at_swap: send ourselves this signal right after the old checkpoint was moved aside, before the new one
#   moves in (SIGKILL: nothing can clean up; SIGINT: held until both renames are done)
FAULTS = r"""
import json, os, signal, sys, time
from pathlib import Path
import gpt2port.formats.safetensors as W
import gpt2port.fsio as fsio

spec = json.loads(os.environ.get("GPT2PORT_TEST_FAULT", "{}"))
if "started" in spec:
    _write = W.StreamingSafetensorsWriter.write
    def write(self, name, tensor):
        if self._next == 0:
            Path(spec["started"]).write_text(str(os.getpid()))
            while "go" in spec and not os.path.exists(spec["go"]):
                time.sleep(0.005)
        time.sleep(spec.get("slow", 0))
        return _write(self, name, tensor)
    W.StreamingSafetensorsWriter.write = write
if "signal_at_swap" in spec:
    _rename = os.rename
    def rename(src, dst, *a, **k):
        _rename(src, dst, *a, **k)
        if fsio.OLD_MARK in os.path.basename(str(dst)):
            os.kill(os.getpid(), getattr(signal, spec["signal_at_swap"]))
    os.rename = rename

from gpt2port.cli import main
main(args=sys.argv[1:], prog_name="gpt2port")
"""


def start_cli(*args, fault: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "GPT2PORT_TEST_FAULT": json.dumps(fault or {})}
    return subprocess.Popen([sys.executable, "-c", FAULTS, *map(str, args)],
                            **interruptible(env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"process ended before {path} appeared: {proc.communicate()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{path} never appeared")
        time.sleep(0.01)


@pytest.fixture(scope="session")
def tiny_src(make_hf_repo) -> Path:
    return make_hf_repo("hub")


def force_if(dest: Path) -> list[str]:
    return ["--force"] if dest.exists() else []


# --- disk full --------------------------------------------------------------------------------------------------------

class _FullDisk(io.FileIO):
    """A file on a disk with `budget[0]` bytes left: a write that crosses it is cut short, the next one fails ENOSPC,
    as write(2) does on a full filesystem. Wrapped in a BufferedWriter like any open(..., 'wb')."""

    budget = [0]

    def write(self, b):
        n = memoryview(b).nbytes
        left = _FullDisk.budget[0]
        if n <= left:
            _FullDisk.budget[0] -= n
            return super().write(b)
        _FullDisk.budget[0] = 0
        if left:
            return super().write(memoryview(b).cast("B")[:left])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _open_on_full_disk(file, mode="r", *args, **kwargs):
    if "b" in mode and any(c in mode for c in "wxa+"):
        return io.BufferedWriter(_FullDisk(file, mode.replace("b", "")))
    return open(file, mode, *args, **kwargs)


def _write_on_full_disk(fd: int, data, offset: int) -> int:
    n, left = memoryview(data).nbytes, _FullDisk.budget[0]
    if n <= left or left:
        _FullDisk.budget[0] -= min(n, left)
        return os.pwrite(fd, memoryview(data).cast("B")[: min(n, left)], offset)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def full_disk(monkeypatch, writes: str = "direct") -> None:
    """Every file opened for writing by the weights writer and by fsio (config, manifest) runs out of space; the
    weights go through O_DIRECT (writes="direct") or the page cache ("buffered"), failing at the same byte."""
    for mod in (safetensors_mod, fsio_mod, outfile_mod):
        monkeypatch.setattr(mod, "open", _open_on_full_disk, raising=False)
    monkeypatch.setattr(outfile_mod, "_write", _write_on_full_disk)
    monkeypatch.setenv("GPT2PORT_DIRECT_IO", "1" if writes == "direct" else "0")


@pytest.mark.parametrize("writes", ["direct", "buffered"])
@pytest.mark.parametrize("prev", ["absent", "existing", "absent, parents too"])
@pytest.mark.parametrize("where", ["header", "mid-data", "config.json"])
def test_disk_full_injected(where, prev, writes, tiny_src, tiny_ckpt, dest_for, monkeypatch):
    weights_size = (tiny_ckpt / WEIGHTS).stat().st_size
    written = -(-weights_size // outfile_mod.BLOCK) * outfile_mod.BLOCK if writes == "direct" else weights_size
    dest = dest_for(prev)
    if prev == "absent, parents too":  # the directories created for --out go again too
        dest = dest.parent / "new" / "deeper" / "ckpt"
    # The first bytes written are the build directory's stage mark (fsio.make_stage), then the weights.
    mark = len(json.dumps({"tool": "gpt2port", "stage": f".{dest.name}{PARTIAL_MARK}{os.getpid()}"}, indent=2)) + 1
    _FullDisk.budget[0] = mark + {"header": 0, "mid-data": weights_size // 2, "config.json": written + 10}[where]
    full_disk(monkeypatch, writes)
    before_src, before_dest = snapshot(tiny_src), snapshot(dest)
    result = run_cli("convert", tiny_src, "--out", dest, "-q", *force_if(dest))
    line = assert_clean_failure(result, names=["no space left on device"])
    assert (WEIGHTS if where != "config.json" else "config.json") in line
    assert snapshot(tiny_src) == before_src
    assert snapshot(dest) == before_dest
    assert leftovers(dest.parent) == []
    if prev == "absent, parents too":
        assert not (dest.parent.parent).exists()


@pytest.mark.parametrize("to", ["hf", "llmc", "gguf"])
def test_export_disk_full_keeps_the_previous_export(to, tiny_ckpt, tmp_path, monkeypatch):
    """export writes through the same staging: a failed `export --force` leaves the old export and the
    checkpoint it reads from as they were, whichever writer ran out of space."""
    dest = tmp_path / "exported"
    assert run_cli("export", tiny_ckpt, "--out", dest, "--to", to).exit_code == 0
    before_ckpt, before_dest = snapshot(tiny_ckpt), snapshot(dest)
    _FullDisk.budget[0] = 100_000
    full_disk(monkeypatch)
    result = run_cli("export", tiny_ckpt, "--out", dest, "--to", to, "--dtype", "bf16", "--force")
    assert_clean_failure(result, names=["no space left on device"])
    assert snapshot(dest) == before_dest
    assert snapshot(tiny_ckpt) == before_ckpt
    assert leftovers(tmp_path) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    """mount(size) -> a fresh tmpfs of that size (root only; skipped where mounting is not allowed)."""
    mounts = []

    def mount(size: str) -> Path:
        where = tmp_path / f"tmpfs-{len(mounts)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}); "
                        f"test_disk_full_injected covers ENOSPC")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", str(where)], check=True)


@pytest.mark.parametrize("size", ["64k", "3m", "7m"])  # full at: the header, mid-weights, the tokenizer files
def test_disk_full_for_real(size, tiny_src, tiny_ckpt, small_tmpfs):
    """A real full filesystem: the writes, the fsyncs and the close all meet ENOSPC from the kernel."""
    disk = small_tmpfs(size)
    dest = disk / "ckpt"
    before_src = snapshot(tiny_src)
    r = subprocess.run([sys.executable, "-m", "gpt2port", "convert", str(tiny_src), "--out", str(dest), "-q"],
                       capture_output=True, text=True)
    assert_one_line_error(r.returncode, r.stderr, r.stdout, names=[disk, "no space left on device"])
    assert snapshot(tiny_src) == before_src
    assert list(disk.iterdir()) == [], "something was left on the full disk"


# --- signals ----------------------------------------------------------------------------------------------------------

def start_slow_conversion(src: Path, dest: Path, tmp_path: Path):
    """A CLI conversion slowed to a crawl, returned a few tensors in, with snapshots of source and destination."""
    before_src, before_dest = snapshot(src), snapshot(dest)
    started = tmp_path / "started"
    proc = start_cli("convert", src, "--out", dest, "-q", *force_if(dest),
                     fault={"slow": 0.05, "started": str(started)})
    wait_for(started, proc)
    time.sleep(0.2)
    return proc, before_src, before_dest


@pytest.mark.parametrize("prev", ["absent", "existing"])
def test_ctrl_c_mid_conversion(prev, tiny_src, dest_for, tmp_path):
    dest = dest_for(prev)
    proc, before_src, before_dest = start_slow_conversion(tiny_src, dest, tmp_path)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert_one_line_error(proc.returncode, err, out, names=["interrupted"])
    assert snapshot(tiny_src) == before_src
    assert snapshot(dest) == before_dest
    assert leftovers(dest.parent) == []


@pytest.mark.parametrize("prev", ["absent", "existing"])
def test_sigkill_mid_conversion_then_next_run_sweeps(prev, tiny_src, dest_for, tmp_path):
    dest = dest_for(prev)
    proc, before_src, before_dest = start_slow_conversion(tiny_src, dest, tmp_path)
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    # Nothing could clean up: the half-built directory is there, under its temporary name only.
    assert leftovers(dest.parent) == [f".{dest.name}{PARTIAL_MARK}{proc.pid}"]
    assert snapshot(dest) == before_dest
    assert snapshot(tiny_src) == before_src
    # The next run sweeps it (its process is gone) and completes.
    result = run_cli("convert", tiny_src, "--out", dest, "-q", *force_if(dest))
    assert result.exit_code == 0, result.stderr
    assert leftovers(dest.parent) == []
    assert_valid_checkpoint(dest)


def test_sigkill_between_the_renames_of_a_replacement(tiny_src, dest_for):
    """The one moment the final name is empty: the old checkpoint moved aside, the new one not yet in. SIGINT and
    SIGTERM are held over those two renames; SIGKILL cannot be. The next run puts the old checkpoint back."""
    dest = dest_for("existing")
    before_dest = snapshot(dest)
    proc = start_cli("convert", tiny_src, "--out", dest, "-q", "--force", fault={"signal_at_swap": "SIGKILL"})
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert not dest.exists()
    assert sorted(leftovers(dest.parent)) == sorted([f".{dest.name}.replaced-{proc.pid}",
                                                     f".{dest.name}{PARTIAL_MARK}{proc.pid}"])
    # Any next conversion to that name restores the old checkpoint first; this one (no --force) then refuses.
    result = run_cli("convert", tiny_src, "--out", dest, "-q")
    assert_clean_failure(result, names=[dest, "--force"])
    assert snapshot(dest) == before_dest
    assert leftovers(dest.parent) == []


def test_ctrl_c_between_the_renames_is_held_until_they_are_done(tiny_src, dest_for):
    """Ctrl-C at the worst moment: it waits for the second rename, so the name holds the new checkpoint (fp16 here,
    the old one is fp32), and the moved-aside old copy is still removed."""
    dest = dest_for("existing")
    proc = start_cli("convert", tiny_src, "--out", dest, "-q", "--force", "--dtype", "fp16",
                     fault={"signal_at_swap": "SIGINT"})
    out, err = proc.communicate(timeout=120)
    assert_one_line_error(proc.returncode, err, out, names=["interrupted"])
    assert proc.returncode == 130
    assert_valid_checkpoint(dest)
    assert json.loads((dest / "manifest.json").read_text())["dtype"] == "fp16"
    assert leftovers(dest.parent) == []


# --- the post-write check ---------------------------------------------------------------------------------------------

def _failing_check(path, entries, metadata):
    raise GPT2PortError(f"{path}: post-write check failed: simulated")


def _corrupting_check(path, entries, metadata, _real=safetensors_mod.check_written):
    """What a bad disk or a concurrent writer would do: the bytes on disk differ from what was written."""
    raw = bytearray(Path(path).read_bytes())
    at = raw.index(b"tok_emb.weight")
    raw[at:at + 7] = b"tok_emX"
    Path(path).write_bytes(bytes(raw))
    _real(path, entries, metadata)


@pytest.mark.parametrize("prev", ["absent", "existing"])
@pytest.mark.parametrize("check", [_failing_check, _corrupting_check], ids=["check raises", "file corrupted"])
def test_post_write_check_failure(check, prev, tiny_src, dest_for, monkeypatch):
    monkeypatch.setattr(safetensors_mod, "check_written", check)
    dest = dest_for(prev)
    before_src, before_dest = snapshot(tiny_src), snapshot(dest)
    result = run_cli("convert", tiny_src, "--out", dest, "-q", *force_if(dest))
    assert_clean_failure(result, names=[WEIGHTS, "post-write check failed"])
    assert snapshot(tiny_src) == before_src
    assert snapshot(dest) == before_dest
    assert leftovers(dest.parent) == []


# --- two conversions, one destination ---------------------------------------------------------------------------------

def race(dest: Path, src: Path, tmp_path: Path, *extra) -> list[tuple[str, str, int]]:
    """Two conversions to `dest`, both held at their first tensor until both are there (so both have passed the
    'exists?' check), then released together. Returns [(stdout, stderr, returncode)] of each."""
    go = tmp_path / "go"
    procs = []
    for i in range(2):
        started = tmp_path / f"started-{i}"
        procs.append(start_cli("convert", src, "--out", dest, "-q", *extra,
                               fault={"started": str(started), "go": str(go), "slow": 0.01}))
        wait_for(started, procs[-1])
    go.touch()
    return [p.communicate(timeout=120) + (p.returncode,) for p in procs]


def test_two_conversions_race_for_one_destination(tiny_src, tiny_ckpt, dest_for, tmp_path):
    """Neither was told --force, so the first to finish gets the name and the other must not replace it:
    one clean error, one complete checkpoint, never a mix."""
    dest = dest_for("absent")
    results = race(dest, tiny_src, tmp_path)
    assert sorted(rc for _, _, rc in results) == [0, 1], results
    out, err, rc = next(r for r in results if r[2] != 0)
    assert_one_line_error(rc, err, out, names=[dest])
    assert_valid_checkpoint(dest)
    assert (dest / WEIGHTS).read_bytes() == (tiny_ckpt / WEIGHTS).read_bytes()
    assert leftovers(dest.parent) == []


def test_destination_taken_at_the_last_moment(tmp_path, monkeypatch):
    """The narrowest race: another run's checkpoint lands between our last check and our rename. The rename of a
    directory onto a non-empty one fails; that must be one clean error, theirs intact, ours gone."""
    dest = tmp_path / "ckpt"
    real_rename = os.rename

    def rename_after_the_other_run(src, dst, *a, **k):
        if Path(dst) == dest and not dest.exists():
            dest.mkdir()
            (dest / "theirs").write_text("complete")
        return real_rename(src, dst, *a, **k)

    with pytest.raises(GPT2PortError, match=str(dest)):
        with staged_directory(dest) as stage:  # ours written as outputs are: via fsio, recorded
            write_file(stage / "ours", b"complete")
            write_mark(stage / "manifest.json", {"tool": "gpt2port", "layout": "gguf"})
            monkeypatch.setattr(os, "rename", rename_after_the_other_run)
    assert [p.name for p in dest.iterdir()] == ["theirs"]
    assert leftovers(tmp_path) == []


def test_two_forced_conversions_leave_one_complete_checkpoint(tiny_src, tiny_ckpt, dest_for, tmp_path):
    """Both told --force: either may win, or both in turn; the name ends up holding one complete checkpoint."""
    dest = dest_for("existing")
    results = race(dest, tiny_src, tmp_path, "--force")
    assert [rc for _, _, rc in results].count(0) >= 1, results
    for out, err, rc in results:
        if rc != 0:
            assert_one_line_error(rc, err, out, names=[dest])
    assert_valid_checkpoint(dest)
    assert (dest / WEIGHTS).read_bytes() == (tiny_ckpt / WEIGHTS).read_bytes()
    assert leftovers(dest.parent) == []


# --- leftovers belong to their own destination ------------------------------------------------------------------------

def _dead_pid() -> int:
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # above pid_max: no process can have it


def test_sweep_touches_only_its_own_destinations_leftovers(tmp_path, tiny_ckpt):
    """A destination named like a glob ('run*', 'ckpt[1]') must not sweep up, or restore into itself, another
    checkpoint's moved-aside directory."""
    theirs = tmp_path / f".run1.replaced-{_dead_pid()}"
    shutil.copytree(tiny_ckpt, theirs)  # a checkpoint of gpt2port's, moved aside by a run that was killed
    before = snapshot(theirs)
    for name in ("run*", "run?", "ru[n]1"):
        assert sweep_leftovers(tmp_path / name) == []
        assert not (tmp_path / name).exists()
    assert snapshot(theirs) == before
    # while its own name does get it back
    assert sweep_leftovers(tmp_path / "run1") == [theirs]
    assert snapshot(tmp_path / "run1") == before


def test_sweep_spares_a_live_runs_directory(tmp_path):
    live = tmp_path / f".ckpt{PARTIAL_MARK}{os.getpid()}"
    live.mkdir()
    assert sweep_leftovers(tmp_path / "ckpt") == []
    assert live.is_dir()


# --- full size: the same promises when the write takes real time ------------------------------------------------------

@pytest.mark.heavy  # a second size of a check the default run makes on the tiny model
@pytest.mark.fullsize
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_signal_during_a_124m_conversion(sig, gpt2_hf_repo, gpt2_ckpt, tmp_path):
    """No slowed writer: a real 124M conversion, signalled once its weights file has begun to fill."""
    dest = tmp_path / "gpt2"
    shutil.copytree(gpt2_ckpt, dest)
    before_dest = snapshot(dest)
    src_facts = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in gpt2_hf_repo.iterdir()}
    proc = start_cli("convert", gpt2_hf_repo, "--out", dest, "-q", "--force")
    partial = tmp_path / f".gpt2{PARTIAL_MARK}{proc.pid}" / WEIGHTS
    deadline = time.monotonic() + 120
    while not (partial.exists() and partial.stat().st_size > 10_000_000):
        assert proc.poll() is None, f"finished before it could be interrupted: {proc.communicate()}"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    if sig == signal.SIGINT:
        assert_one_line_error(proc.returncode, err, out, names=["interrupted"])
        assert leftovers(tmp_path) == []
    else:
        assert proc.returncode == -signal.SIGKILL
        assert leftovers(tmp_path) == [partial.parent.name]
        assert sweep_leftovers(dest) == [partial.parent]
    assert snapshot(dest) == before_dest  # 500 MB hashed, byte for byte
    assert {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in gpt2_hf_repo.iterdir()} == src_facts


# --- the soak check (scripts/soak.py) ---------------------------------------------------------------------------------

def test_soak_leak_detector_sees_each_kind_of_leak(tmp_path):
    """The soak's 'no leaks' verdict means something only if each kind of leak would be caught."""
    import mmap
    import threading

    from scripts import soak

    dest = tmp_path / "checkpoints" / "gpt2"
    dest.parent.mkdir(parents=True)
    base = soak.Baseline()
    assert base.leaks(tmp_path, dest) == []
    held = open(tmp_path / "held.bin", "wb+")
    held.write(b"\0" * 4096)
    held.flush()
    mapped = mmap.mmap(held.fileno(), 4096)
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="leaky-worker")
    worker.start()
    (dest.parent / f".gpt2{PARTIAL_MARK}1").mkdir()
    try:
        found = " | ".join(base.leaks(tmp_path, dest))
        assert "file descriptor" in found and "held.bin" in found
        assert "memory-mapped" in found
        assert "leaky-worker" in found
        assert ".gpt2.partial-1" in found
    finally:
        stop.set()
        worker.join()
        mapped.close()
        held.close()


@pytest.mark.heavy
def test_soak_gpt2(tmp_path):
    """scripts/soak.py at 124M: two back-to-back conversions and a verification, no leaks. ~1-3 min."""
    report = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, "-m", "scripts.soak", "--sizes", "gpt2", "--rounds", "2", "--json", str(report),
                        "--workdir", str(tmp_path / "w")],
                       cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(report.read_text())["rows"]
    converts = [row for row in rows if row["step"].startswith("convert")]
    assert len(converts) == 2 and all(row["leaks"] == [] for row in converts)
    # Streaming: the convert step's own peak stays far below the 0.5 GB model plus a copy of it.
    assert all(row["peak_rss_gb"] - row["rss_before_gb"] < 0.5 for row in converts), converts
    assert [row["passed"] for row in rows if row["step"] == "verify"] == [True]
    assert list((tmp_path / "w").glob("**/.*partial*")) == []


# --- download: a failed replacement keeps the old checkpoint and the Hugging Face cache -------------------------------
# (the download faults themselves, cut connections and corrupted bodies, are tested in test_hub.py)

@pytest.fixture
def small_hub(tmp_path, tiny_hf_model):
    root = tmp_path / "hub-root"
    fill_fake_hub.write_hub_repo(root, "someone/tiny-gpt2", tiny_hf_model)
    fill_fake_hub.write_hub_repo(root, "someone/tiny-gpt2", tiny_hf_model, revision="v1", dtype="fp16")
    with fake_hub.FakeHub(root) as hub:
        yield hub


def download_cli(hub, home: Path, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home / "hf"), HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1")
    return subprocess.run([sys.executable, "-m", "gpt2port", "download", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=home, timeout=300)


def test_failed_download_replacement_keeps_checkpoint_and_cache(small_hub, tmp_path):
    dest = tmp_path / "ckpt"
    first = download_cli(small_hub, tmp_path, "someone/tiny-gpt2", "--out", dest, "-q")
    assert first.returncode == 0, first.stderr
    cache = tmp_path / "hf" / "hub" / "models--someone--tiny-gpt2"
    before_dest, before_cache = snapshot(dest), snapshot(cache)
    small_hub.set_faults({"corrupt": {"model.safetensors": -1}})  # every copy of the weights arrives damaged
    r = download_cli(small_hub, tmp_path, "someone/tiny-gpt2", "--revision", "v1", "--out", dest, "--force", "-q")
    assert_one_line_error(r.returncode, r.stderr, r.stdout, names=["someone/tiny-gpt2", "model.safetensors"])
    assert snapshot(dest) == before_dest
    assert leftovers(tmp_path) == []
    # What the first download put in the cache (the source of the checkpoint) is untouched, byte for byte.
    after_cache = snapshot(cache)
    assert {k: v for k, v in after_cache.items() if k in before_cache} == before_cache


def test_force_through_a_symlinked_destination_replaces_the_target(tiny_src, tiny_ckpt, tmp_path):
    """checkpoints/ckpt -> ../big-disk/ckpt: --force replaces the checkpoint where it lives; the link keeps working
    and nothing is left in either directory."""
    target = tmp_path / "big-disk" / "ckpt"
    shutil.copytree(tiny_ckpt, target)
    link = tmp_path / "checkpoints" / "ckpt"
    link.parent.mkdir()
    link.symlink_to(Path("..") / "big-disk" / "ckpt", target_is_directory=True)
    result = run_cli("convert", tiny_src, "--out", link, "-q", "--force", "--dtype", "fp16")
    assert result.exit_code == 0, result.stderr
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert json.loads((target / "manifest.json").read_text())["dtype"] == "fp16"
    assert_valid_checkpoint(link)
    assert leftovers(link.parent) == [] and leftovers(target.parent) == []
