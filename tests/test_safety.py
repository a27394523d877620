"""Bad inputs and hostile files never cost a user their data (faults mid-run are in test_faults.py).

Every case drives the real CLI and checks the whole promise, not just "it failed":
  - exit code != 0, exactly ONE line on stderr, starting "error: " and naming the path (and key) at fault,
    no traceback;
  - the source's bytes, size and mtime unchanged (sha256 + size + mtime_ns snapshot of every file under it);
  - nothing left beside the destination (no .NAME.partial-* / .NAME.replaced-* directories);
  - a previous checkpoint at the destination byte-identical, even when --force asked to replace it.

Most cases run in-process through click's CliRunner (fast); the ones where what reaches a real terminal matters
(warnings printed by torch, a pickle payload) run `python -m gpt2port` in a subprocess.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support import (WEIGHTS, assert_clean_failure, assert_one_line_error, assert_valid_checkpoint, leftovers,
                           run_cli, run_module, snapshot)


# --- fixtures ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def base_repo(make_hf_repo) -> Path:
    """The tiny random GPT-2 in the 2019 hub layout (bare keys, mask buffers), shared read-only by every case."""
    return make_hf_repo("hub")


@pytest.fixture(scope="session")
def base_tensors(base_repo) -> dict[str, torch.Tensor]:
    return load_file(base_repo / WEIGHTS)


@pytest.fixture
def src(tmp_path, base_repo) -> Path:
    """A private copy of the tiny hub repo, for a case to damage."""
    out = tmp_path / "src"
    shutil.copytree(base_repo, out)
    return out


def fails_safely(src: Path, dest: Path, *extra, names=(), env=None) -> str:
    """Run `convert src --out dest` expecting a clean refusal; check the whole promise. Returns the error line."""
    before_src, before_dest = snapshot(src), snapshot(dest)
    args = ["convert", src, "--out", dest, "--quiet", *extra]
    if before_dest:
        args.append("--force")  # even when told to replace, a failed conversion must not touch the old checkpoint
    line = assert_clean_failure(run_cli(*args, env=env), names)
    assert snapshot(src) == before_src, "source changed"
    assert snapshot(dest) == before_dest, "previous output changed"
    assert leftovers(dest.parent) == []
    return line


# --- hand-made damage ------------------------------------------------------------------------------------------------

def split_file(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join_file(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def edit_header(path: Path, edit) -> None:
    header, data = split_file(path)
    edit(header)
    join_file(path, header, data)


def rewrite_tensors(path: Path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def header_len(path: Path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


def _overlap(path: Path) -> None:
    """ln_f.bias claims the first bytes of the data (another tensor's), and its own bytes are cut out, later
    offsets shifted down: two tensors share one region, with no gap and no excess anywhere."""
    header, data = split_file(path)
    start, end = header["ln_f.bias"]["data_offsets"]
    for k, info in header.items():
        if k != "__metadata__" and info["data_offsets"][0] >= end:
            info["data_offsets"] = [o - (end - start) for o in info["data_offsets"]]
    header["ln_f.bias"]["data_offsets"] = [0, end - start]
    join_file(path, header, data[:start] + data[end:])


def _garbage_header(path: Path) -> None:
    n = header_len(path)
    raw = bytearray(path.read_bytes())
    raw[8:8 + n] = b"\x00not json" + b"!" * (n - 9)
    path.write_bytes(bytes(raw))


def _shape_vs_offsets(h):
    h["h.1.mlp.c_fc.weight"]["shape"] = [32, 129]  # 129 x 32 x 4 bytes != the 128-column region it claims


def _dtype_vs_offsets(h):
    h["wpe.weight"]["dtype"] = "F16"  # half the bytes its offsets span


def _with_extra_key(t):
    t["h.0.attn.rotary.weight"] = torch.zeros(4)


def _without_key(t):
    del t["h.1.ln_2.bias"]


def _misshaped(t):
    t["h.0.attn.c_proj.weight"] = torch.zeros(32, 16)


def _int_embedding(t):
    t["wte.weight"] = t["wte.weight"].to(torch.int32)


def _medium_config(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(n_layer=24, n_head=16, n_embd=1024)  # gpt2-medium's shape, over the tiny weights
    (d / "config.json").write_text(json.dumps(cfg))


def _config_edit(**fields):
    def edit(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(fields)
        (d / "config.json").write_text(json.dumps(cfg))
    return edit


# case id -> (damage(src_dir), relative path the message must name or None for the repo dir, other words it must name)
BAD_SOURCES = {
    "empty dir": (lambda d: [p.unlink() for p in d.iterdir()], None, ["no GPT-2 weights"]),
    "config only": (lambda d: [p.unlink() for p in d.iterdir() if p.name != "config.json"], None, ["no GPT-2 weights"]),
    "weights file is a directory": (lambda d: ((d / WEIGHTS).unlink(), (d / WEIGHTS).mkdir()), WEIGHTS,
                                    ["directory"]),
    "weights file a dangling symlink": (lambda d: ((d / WEIGHTS).unlink(), (d / WEIGHTS).symlink_to(
        d / "blobs" / ("0" * 64))), WEIGHTS, ["broken symbolic link"]),
    "empty weights file": (lambda d: truncate(d / WEIGHTS, 0), WEIGHTS, ["empty"]),
    "truncated to 4 bytes": (lambda d: truncate(d / WEIGHTS, 4), WEIGHTS, ["truncated"]),
    "truncated mid-header": (lambda d: truncate(d / WEIGHTS, 8 + header_len(d / WEIGHTS) // 2), WEIGHTS,
                             ["truncated"]),
    "truncated mid-data": (lambda d: truncate(d / WEIGHTS, (d / WEIGHTS).stat().st_size // 2), WEIGHTS,
                           ["truncated"]),
    "header length beyond the file": (lambda d: (d / WEIGHTS).write_bytes(
        struct.pack("<Q", (d / WEIGHTS).stat().st_size) + (d / WEIGHTS).read_bytes()[8:]), WEIGHTS, ["header"]),
    "header not JSON": (lambda d: _garbage_header(d / WEIGHTS), WEIGHTS, ["JSON"]),
    "header a JSON list": (lambda d: join_file(d / WEIGHTS, [1, 2], b""), WEIGHTS, ["JSON object"]),
    "overlapping offsets": (lambda d: _overlap(d / WEIGHTS), WEIGHTS, ["overlaps"]),
    "holed offsets": (lambda d: edit_header(d / WEIGHTS, lambda h: h.pop("h.0.ln_2.weight")), WEIGHTS, ["gap"]),
    "shape x dtype vs offsets (shape)": (lambda d: edit_header(d / WEIGHTS, _shape_vs_offsets), WEIGHTS,
                                         ["h.1.mlp.c_fc.weight"]),
    "shape x dtype vs offsets (dtype)": (lambda d: edit_header(d / WEIGHTS, _dtype_vs_offsets), WEIGHTS,
                                         ["wpe.weight"]),
    "dtype not a string": (lambda d: edit_header(d / WEIGHTS, lambda h: h["wte.weight"].update(dtype=["F32"])),
                           WEIGHTS, ["wte.weight", "dtype"]),
    "unknown dtype": (lambda d: edit_header(d / WEIGHTS, lambda h: h["wte.weight"].update(dtype="F8_E9M9")),
                      WEIGHTS, ["wte.weight", "dtype"]),
    "negative shape": (lambda d: edit_header(d / WEIGHTS, lambda h: h["wte.weight"].update(shape=[-1, 32])),
                       WEIGHTS, ["wte.weight", "shape"]),
    "offsets past the end": (lambda d: edit_header(d / WEIGHTS, lambda h: h["ln_f.bias"].update(
        data_offsets=[h["ln_f.bias"]["data_offsets"][0] + 10**9, h["ln_f.bias"]["data_offsets"][1] + 10**9])),
        WEIGHTS, []),
    "metadata not strings": (lambda d: edit_header(d / WEIGHTS, lambda h: h.update(__metadata__={"format": 1})),
                             WEIGHTS, ["metadata"]),
    "git LFS pointer as model.safetensors": (lambda d: (d / WEIGHTS).write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 548105171\n"), WEIGHTS,
        ["LFS pointer"]),
    "unknown key": (lambda d: rewrite_tensors(d / WEIGHTS, _with_extra_key), WEIGHTS, ["h.0.attn.rotary.weight"]),
    "missing key": (lambda d: rewrite_tensors(d / WEIGHTS, _without_key), WEIGHTS, ["h.1.ln_2.bias"]),
    "mis-shaped key": (lambda d: rewrite_tensors(d / WEIGHTS, _misshaped), WEIGHTS,
                       ["h.0.attn.c_proj.weight", "(32, 16)"]),
    "integer weights": (lambda d: rewrite_tensors(d / WEIGHTS, _int_embedding), WEIGHTS, ["wte.weight", "int32"]),
    "config says medium, weights are tiny": (_medium_config, "config.json", ["says 24 layers", "hold 2"]),
    "config one layer too many": (_config_edit(n_layer=3), "config.json", ["says 3 layers", "hold 2"]),
    "config vocab disagrees": (_config_edit(vocab_size=50304), "config.json", ["50304", "50257"]),
    "config n_layer not a number": (_config_edit(n_layer="twelve"), "config.json", ["n_layer"]),
    "config n_head zero": (_config_edit(n_head=0), "config.json", ["n_head"]),
    "config n_layer absurd": (_config_edit(n_layer=10**12), "config.json", ["layers"]),
    "config not JSON": (lambda d: (d / "config.json").write_text("{n_layer: 2"), "config.json", ["JSON"]),
    "config not GPT-2": (_config_edit(model_type="llama"), "config.json", ["llama"]),
}


@pytest.mark.parametrize("prev", ["absent", "existing"])
@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_bad_source_is_refused_cleanly(case, prev, src, dest_for):
    damage, culprit, words = BAD_SOURCES[case]
    damage(src)
    fails_safely(src, dest_for(prev), names=[src / culprit if culprit else src, *words])


def test_missing_source(tmp_path, dest_for):
    missing = tmp_path / "nowhere"
    line = fails_safely(missing, dest_for("absent"), names=[missing])
    assert "no such file" in line


def test_file_where_a_directory_is_expected(tmp_path, src, dest_for):
    # a stray file as SRC
    stray = tmp_path / "notes.txt"
    stray.write_text("not weights")
    fails_safely(stray, dest_for("absent"), names=[stray])
    # a file in the way of --out, and a file in the way of --out's parent
    for blocker, dest in [(tmp_path / "blocker", tmp_path / "blocker"),
                          (tmp_path / "blocker2", tmp_path / "blocker2" / "ckpt")]:
        blocker.write_text("precious")
        before = snapshot(blocker)
        result = run_cli("convert", src, "--out", dest, "--force", "-q")
        assert_clean_failure(result, names=[blocker])
        assert snapshot(blocker) == before
        assert leftovers(blocker.parent) == []


def test_directory_where_a_file_is_expected(tmp_path, tiny_ckpt):
    # info/export take a checkpoint directory; a weights file given instead is named as such
    result = run_cli("info", tiny_ckpt / WEIGHTS)
    assert_clean_failure(result, names=[tiny_ckpt / WEIGHTS])


# --- sharded and pickled sources --------------------------------------------------------------------------------------

@pytest.fixture
def sharded_src(tmp_path, make_hf_repo) -> Path:
    out = tmp_path / "sharded"
    shutil.copytree(make_hf_repo("sharded"), out)
    return out


def _index(d: Path) -> dict:
    return json.loads((d / "model.safetensors.index.json").read_text())


def _write_index(d: Path, index: dict) -> None:
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_missing_shard(sharded_src, dest_for):
    shard = sorted(sharded_src.glob("model-*.safetensors"))[-1]
    shard.unlink()
    fails_safely(sharded_src, dest_for("existing"), names=[shard, "missing"])


def test_sharded_index_pointing_outside_the_repo_is_refused(sharded_src, tmp_path, dest_for):
    """A hostile index must not make gpt2port read (and hash into a manifest) files elsewhere on the disk."""
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copyfile(sorted(sharded_src.glob("model-*.safetensors"))[0], outside)
    index = _index(sharded_src)
    first = sorted(index["weight_map"].values())[0]
    index["weight_map"] = {k: ("../elsewhere.safetensors" if v == first else v) for k, v in index["weight_map"].items()}
    _write_index(sharded_src, index)
    fails_safely(sharded_src, dest_for("absent"),
                 names=["model.safetensors.index.json", "'../elsewhere.safetensors'", "not a file name"])


def test_sharded_index_with_non_string_shard(sharded_src, dest_for):
    index = _index(sharded_src)
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = 3
    _write_index(sharded_src, index)
    fails_safely(sharded_src, dest_for("absent"), names=["model.safetensors.index.json", key])


def test_truncated_pytorch_bin(tmp_path, make_hf_repo, dest_for):
    d = tmp_path / "bin"
    shutil.copytree(make_hf_repo("bin"), d)
    truncate(d / "pytorch_model.bin", (d / "pytorch_model.bin").stat().st_size // 2)
    fails_safely(d, dest_for("existing"), names=[d / "pytorch_model.bin"])


class _WritesAFile:
    """Unpickling this calls open(marker, 'w'): a stand-in for any code a hostile pickle would run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("fmt", ["torch.save zip", "plain pickle"])
def test_pickle_payload_never_runs(tmp_path, fmt):
    """pytorch_model.bin is a pickle. gpt2port loads it with torch.load(weights_only=True), which refuses any
    global that is not a tensor or a plain container: the payload's open() must never be called."""
    marker = tmp_path / "PWNED"
    d = tmp_path / "evil"
    d.mkdir()
    payload = {"wte.weight": torch.zeros(2, 2), "h.0.ln_1.weight": _WritesAFile(str(marker))}
    if fmt == "plain pickle":
        (d / "pytorch_model.bin").write_bytes(pickle.dumps(payload, protocol=4))
    else:
        torch.save(payload, d / "pytorch_model.bin")
    # Prove the payload is live: plain unpickling would run it (in a throwaway process, on a decoy marker).
    decoy = tmp_path / "decoy"
    probe = d / "probe.bin"
    probe.write_bytes(pickle.dumps(_WritesAFile(str(decoy)), protocol=4))
    subprocess.run([sys.executable, "-c", f"import pickle; pickle.load(open({str(probe)!r}, 'rb'))"], check=True)
    assert decoy.exists()
    probe.unlink()

    before = snapshot(d)
    dest = tmp_path / "out"
    proc = run_module("convert", d, "--out", dest, "--quiet")
    line = assert_one_line_error(proc.returncode, proc.stderr, proc.stdout, names=[d / "pytorch_model.bin"])
    assert "weights_only" in line and "\x1b" not in line
    assert not marker.exists(), "the pickle payload ran"
    assert snapshot(d) == before
    assert not dest.exists() and leftovers(tmp_path) == []


# --- weights that are odd but convertible -----------------------------------------------------------------------------

def test_nan_and_inf_weights_warn_by_name_and_convert(src, tmp_path):
    def poison(t):
        t["h.1.mlp.c_fc.weight"][3, 5] = float("nan")
        t["wpe.weight"][0, 0] = float("inf")
    rewrite_tensors(src / WEIGHTS, poison)
    before = snapshot(src)
    dest = tmp_path / "out"
    result = run_cli("convert", src, "--out", dest, "-q")
    assert result.exit_code == 0, result.stderr
    warnings = [ln for ln in result.stderr.splitlines() if ln.startswith("warning: ")]
    assert any("'h.1.mlp.c_fc.weight'" in w and "NaN" in w for w in warnings), result.stderr
    assert any("'wpe.weight'" in w for w in warnings), result.stderr
    assert snapshot(src) == before
    assert_valid_checkpoint(dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    assert len(manifest["warnings"]) == 2


def test_integer_mask_buffers_are_fine(src, tmp_path):
    """Only parameters must be float: the dropped causal-mask buffers come as bool/uint8 in some files."""
    def int_masks(t):
        for k in [k for k in t if k.endswith(".attn.bias")]:
            t[k] = t[k].to(torch.uint8)
    rewrite_tensors(src / WEIGHTS, int_masks)
    dest = tmp_path / "out"
    result = run_cli("convert", src, "--out", dest, "-q")
    assert result.exit_code == 0, result.stderr
    assert_valid_checkpoint(dest)


# --- where the output may go ------------------------------------------------------------------------------------------

def test_output_equal_to_the_source_is_refused(src):
    fails_safely(src, src, names=[src])


def test_output_equal_to_the_weights_file_is_refused(src):
    fails_safely(src / WEIGHTS, src / WEIGHTS, names=[src / WEIGHTS])


def test_output_inside_the_source_is_refused(src):
    fails_safely(src, src / "converted", names=[src / "converted"])


def test_output_around_the_source_is_refused(tmp_path, src):
    """--out PARENT --force would otherwise replace the directory holding the source, source and all."""
    fails_safely(src, tmp_path, names=[tmp_path])


def test_output_through_a_symlink_to_the_source_is_refused(tmp_path, src):
    link = tmp_path / "link"
    link.symlink_to(src, target_is_directory=True)
    fails_safely(src, link, names=[link])


def test_output_inside_the_hf_cache_is_refused(tmp_path, src):
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    dest = cache / "models--openai-community--gpt2" / "converted"
    fails_safely(src, dest, names=[dest, "cache"], env={"HF_HUB_CACHE": str(cache)})
    assert list(cache.iterdir()) == []


def test_export_refuses_an_output_around_the_checkpoint(tmp_path, tiny_ckpt):
    ckpt = tmp_path / "checkpoints" / "tiny"
    shutil.copytree(tiny_ckpt, ckpt)
    before = snapshot(ckpt.parent)
    result = run_cli("export", ckpt, "--out", ckpt.parent, "--force")
    assert_clean_failure(result, names=[ckpt.parent])
    assert snapshot(ckpt.parent) == before
    assert leftovers(tmp_path) == []


def test_existing_output_needs_force(src, dest_for):
    dest = dest_for("existing")
    before = snapshot(dest)
    result = run_cli("convert", src, "--out", dest, "-q")
    assert_clean_failure(result, names=[dest, "--force"])
    assert snapshot(dest) == before


# --- paths and permissions that must simply work ----------------------------------------------------------------------

def test_unicode_and_space_paths(tmp_path, base_repo):
    src = tmp_path / "modèle GPT-2 ✓ (copie)"
    shutil.copytree(base_repo, src)
    dest = tmp_path / "sortie à 東京" / "mon point de contrôle"
    before = snapshot(src)
    result = run_cli("convert", src, "--out", dest, "-q")
    assert result.exit_code == 0, result.stderr
    assert_valid_checkpoint(dest)
    assert snapshot(src) == before
    # and a failure there still names the path exactly
    result = run_cli("convert", src, "--out", dest, "-q")
    assert_clean_failure(result, names=[dest])


@pytest.fixture
def read_only_copy(tmp_path):
    """read_only_copy(dir) -> (a copy where writing is impossible, even for root, mounted?): a read-only bind mount
    when we may mount, else a chmod a-w tree (which binds only non-root users)."""
    mounts, trees = [], []

    def make(original: Path):
        writable = tmp_path / f"writable-{original.name}"
        shutil.copytree(original, writable)
        ro = tmp_path / f"read-only-{original.name}"
        ro.mkdir()
        mounted = os.geteuid() == 0 and subprocess.run(
            ["mount", "--bind", "-o", "ro", str(writable), str(ro)], capture_output=True).returncode == 0
        if mounted:
            mounts.append(ro)
            subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True)
            with pytest.raises(OSError):  # the mount really refuses writes: a write-mode open would fail
                open(ro / "probe", "w")
        else:
            ro.rmdir()
            shutil.copytree(original, ro)
            for p in [*ro.iterdir(), ro]:
                p.chmod(0o555 if p.is_dir() else 0o444)
            trees.append(ro)
        return ro, mounted

    yield make
    # A model the test let go of may still wait in a reference cycle (click's test runner keeps the exception state
    # of the commands it ran); its memory map of the checkpoint would keep the mount busy until the collector runs.
    gc.collect()
    for ro in mounts:
        subprocess.run(["umount", str(ro)], check=True)
    for ro in trees:
        ro.chmod(0o755)


def test_read_only_source_converts(tmp_path, base_repo, read_only_copy):
    ro, _ = read_only_copy(base_repo)
    before = snapshot(ro)
    dest = tmp_path / "out"
    result = run_cli("convert", ro, "--out", dest, "-q")
    assert result.exit_code == 0, result.stderr
    assert_valid_checkpoint(dest)
    assert snapshot(ro) == before


def test_read_only_checkpoint_loads_exports_and_reports(tmp_path, tiny_ckpt, read_only_copy):
    from gpt2port import GPT

    ro, _ = read_only_copy(tiny_ckpt)
    before = snapshot(ro)
    assert run_cli("info", ro).exit_code == 0
    assert run_cli("export", ro, "--out", tmp_path / "hf", "--to", "hf").exit_code == 0
    model = GPT.from_pretrained(ro)
    with torch.no_grad():
        model(torch.tensor([[464, 3290]]))
    assert snapshot(ro) == before


def test_changing_loaded_weights_never_writes_to_the_checkpoint(tmp_path, tiny_ckpt):
    """from_pretrained maps the file copy-on-write: fine-tuning the model in place (what an optimizer does) changes
    private pages, never the file on disk."""
    from gpt2port import GPT

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    before = snapshot(ckpt)
    model = GPT.from_pretrained(ckpt)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    del model
    assert snapshot(ckpt) == before


# --- a failure nobody planned for still ends in one line --------------------------------------------------------------

def test_unexpected_exception_is_one_line_and_debug_shows_traceback(src, tmp_path, monkeypatch):
    import gpt2port.conversion as convert_mod

    def boom(*a, **k):
        raise RuntimeError("simulated bug\nwith a second line")
    monkeypatch.setattr(convert_mod, "open_source", boom)
    line = assert_clean_failure(run_cli("convert", src, "--out", tmp_path / "o", "-q"))
    assert "RuntimeError" in line and "simulated bug" in line and "--debug" in line
    result = run_cli("--debug", "convert", src, "--out", tmp_path / "o", "-q")
    assert isinstance(result.exception, RuntimeError)  # --debug lets it through, traceback and all


# --- limits of the machine and of the options: one line naming what, never "internal error" ------------------------

def _address_space(limit: int):
    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return apply


@pytest.mark.parametrize("mb", [650, 700, 800])
def test_convert_under_an_address_space_cap_is_one_line(mb, base_repo, tmp_path):
    """`ulimit -v`: where the cap leaves no room for a thread's stack or the write buffers, the refusal says so and
    names the file (it was "internal error: can't start new thread", or a bare "Cannot allocate memory")."""
    dest = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "gpt2port", "convert", str(base_repo), "--out", str(dest), "-q"],
                          capture_output=True, text=True, timeout=300, preexec_fn=_address_space(mb << 20))
    if proc.returncode == 0:
        assert_valid_checkpoint(dest)
    else:
        line = assert_one_line_error(proc.returncode, proc.stderr, proc.stdout)
        assert "internal error" not in line and f"out of memory (address space limited to {mb} MB" in line, line
    assert leftovers(tmp_path) == []


def test_generate_threads_beyond_the_machine_is_one_line(tiny_ckpt):
    proc = run_module("generate", tiny_ckpt, "Hi", "-n", "2", "--threads", "100000")
    line = assert_one_line_error(proc.returncode, proc.stderr, proc.stdout, names=["--threads 100000"])
    assert "libgomp" not in proc.stderr, line


def test_verify_reference_pickle_payload_is_refused_without_torchs_advice(tiny_ckpt, base_repo, tmp_path):
    """The reference goes through the same loader as a source: torch's invitation to retry with
    weights_only=False (which would run the payload) is never relayed."""
    marker = tmp_path / "PWNED"
    ref = tmp_path / "ref"
    ref.mkdir()
    shutil.copy(base_repo / "config.json", ref / "config.json")
    torch.save({"wte.weight": torch.zeros(2, 2), "h.0.ln_1.weight": _WritesAFile(str(marker))},
               ref / "pytorch_model.bin")
    proc = run_module("verify", tiny_ckpt, "--reference", ref, "--no-hf", "-q", timeout=300)
    line = assert_one_line_error(proc.returncode, proc.stderr, proc.stdout, names=[ref / "pytorch_model.bin"])
    assert "False" not in line and "safe_globals" not in line and "weights_only=True" in line, line
    assert not marker.exists()
