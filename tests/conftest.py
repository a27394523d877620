"""Shared fixtures: random-weight GPT-2 checkpoints made by transformers, in real HF layouts, built once per session."""

from __future__ import annotations

import atexit
import getpass
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from scripts import hf_fixtures

# Tests must never reach the network: HF libraries stay offline, and the Hub cache lives in a temporary place.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# Under pytest-xdist (-n N) each of N workers gets its share of the cores: two workers of two threads on two cores
# wait on each other's thread teams (on a busy machine, a scheduler slice per op; the one_thread fixture says more).
# A worker's children get the same count: a run in a child compared bit for bit with one in the test's process (a
# resumed fine-tune with the uninterrupted one) sums in the same order only with as many threads.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
torch.set_num_threads(_THREADS)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
# gpt2port's one-row kernel is built afresh for each run (and by the CLI runs it starts), not taken from ~/.cache.
# The directory is made by the process that runs pytest, and removed when it exits; under pytest-xdist its workers
# (started by it after this ran, with its environment) each take a cache of their own inside it, so that a worker's
# tests see the cache as a plain run's see the run's: what is built or compiled there came from that worker's tests
# (tests/fast/test_graph.py counts the packages a compile adds). Inductor's own cache (torch.compile, the step
# compiled ahead of time), which is made for processes sharing it, is the run's one, in that directory too.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and os.environ.get("GPT2PORT_TESTS_TEMP"):
    _RUN_DIR = os.environ["GPT2PORT_TESTS_TEMP"]
    _NATIVE_CACHE = os.path.join(_RUN_DIR, _WORKER)
    os.makedirs(_NATIVE_CACHE, exist_ok=True)
else:
    _RUN_DIR = _NATIVE_CACHE = tempfile.mkdtemp(prefix="gpt2port-native-")
    atexit.register(shutil.rmtree, _RUN_DIR, True)
    os.environ["GPT2PORT_TESTS_TEMP"] = _RUN_DIR
    # Inductor keeps its precompiled headers in its default directory whatever TORCHINDUCTOR_CACHE_DIR says
    # (<temp>/torchinductor_<user>, ~0.9 GB after the compile tests): removed at exit where this run made it
    try:
        _INDUCTOR_DEFAULT = os.path.join(tempfile.gettempdir(),
                                         "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser()))
    except (KeyError, OSError):
        _INDUCTOR_DEFAULT = None
    if _INDUCTOR_DEFAULT is not None and not os.path.exists(_INDUCTOR_DEFAULT):
        atexit.register(shutil.rmtree, _INDUCTOR_DEFAULT, True)
os.environ["GPT2PORT_NATIVE_CACHE"] = _NATIVE_CACHE
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_RUN_DIR, "inductor")

TINY = hf_fixtures.TINY

# `pytest -m quick`: a check of an install in minutes. Every command and the model once, on the tiny fixtures, by
# the tests that prove its main promise (node ids, or a prefix that takes each parametrization); docs/testing.md.
QUICK = (
    "tests/test_package.py::test_no_module_past_a_readable_size",
    "tests/test_package.py::test_help_and_usage_errors_import_neither_torch_nor_transformers",
    "tests/test_model.py::test_logits_to_keep_computes_those_positions_logits",
    "tests/test_checkpoint.py::test_a_changed_model_saves_and_loads_back_exactly",
    "tests/test_convert.py::test_every_layout_converts_to_matching_logits[hub-fp32]",
    "tests/test_convert.py::test_cli_convert_and_info",
    "tests/test_convert.py::test_round_trip_to_hf_is_bit_exact",
    "tests/test_safety.py::test_existing_output_needs_force",
    "tests/hub/test_hub.py::test_download_name_converts_exactly_the_needed_files",
    "tests/verification/test_verify.py::test_cli_json_pass_exit_0",
    "tests/verification/test_verify.py::test_cli_fail_exit_1_text_and_json",
    "tests/test_generate.py::test_greedy_equals_hf_generate_each_prompt",
    "tests/test_generate.py::test_cli_streams_greedy_text_and_reports_prefill_and_decode_apart",
    "tests/formats/test_gguf.py::test_cli_export_gguf",
    "tests/formats/test_llmc.py::test_round_trip_is_bit_exact",
    "tests/evaluation/test_input.py::test_the_table_the_json_and_the_model_card",
    "tests/fast/test_native.py::test_doctor_builds_and_reports",
    "tests/userclass/test_check.py::test_check_passes_and_prints_the_table_and_the_verdict",
    "tests/training/test_finetune.py::test_loss_falls_and_the_result_is_an_ordinary_checkpoint",
    "tests/lora/test_lora_cli.py::test_gpt2port_merge_of_the_run_adapter_gives_the_run_checkpoint",
    "tests/test_quick.py",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "heavy" not in item.keywords and any(
                item.nodeid == q or item.nodeid.startswith(q + ("" if q.endswith(".py") else "[")) or
                item.nodeid.startswith(q + "::") for q in QUICK):
            item.add_marker(pytest.mark.quick)


@pytest.fixture
def one_thread():
    """For the tests of decoding (pytestmark = pytest.mark.usefixtures("one_thread")): correctness does not depend
    on threads, and on a busy 2-core machine each op of a 2-thread team can wait a whole scheduler slice for its
    partner (seen: 10 ms for a LayerNorm of 32 numbers, 5x slower full-size tests)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_hf_model():
    """A tiny GPT2LMHeadModel (2 layers, 32 wide, 64 positions, full 50257 vocab) with random weights."""
    return hf_fixtures.make_hf_model(hf_fixtures.hf_config(TINY), seed=0)


@pytest.fixture(scope="session")
def make_hf_repo(tmp_path_factory, tiny_hf_model):
    """make_hf_repo(layout="hub", dtype="fp32", model=None) -> a directory in that HF layout (cached per session)."""
    made: dict = {}

    def make(layout: str = "hub", dtype: str = "fp32", model=None, tokenizer: bool = True) -> Path:
        key = (layout, dtype, id(model), tokenizer)
        if key not in made:
            out = tmp_path_factory.mktemp(f"hf-{layout}-{dtype}")
            src = model if model is not None else tiny_hf_model
            # write_repo casts in place; keep the session's model in fp32.
            import copy

            hf_fixtures.write_repo(copy.deepcopy(src), out, layout, dtype, tokenizer)
            made[key] = out
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, make_hf_repo):
    """A converted gpt2port checkpoint of the tiny model (fp32, from the hub layout)."""
    from gpt2port import convert

    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    convert(make_hf_repo("hub"), out)
    return out


@pytest.fixture(scope="session")
def gpt2_hf_repo(tmp_path_factory):
    """A full-size (124M-shape) random-weight GPT-2 in the 2019 hub layout."""
    out = tmp_path_factory.mktemp("hf-gpt2-full")
    model = hf_fixtures.make_hf_model(hf_fixtures.hf_config("gpt2"), seed=124)
    hf_fixtures.write_repo(model, out, "hub", "fp32")
    return out


@pytest.fixture(scope="session")
def gpt2_ckpt(tmp_path_factory, gpt2_hf_repo):
    from gpt2port import convert

    out = tmp_path_factory.mktemp("ckpt-full") / "gpt2"
    convert(gpt2_hf_repo, out)
    return out


@pytest.fixture
def dest_for(tmp_path, tiny_ckpt):
    """dest_for(kind) -> a conversion's destination path: 'absent' (nothing there yet) or 'existing' (a converted
    checkpoint already there, which a failed or refused run must leave byte-identical)."""
    import shutil

    def make(kind: str) -> Path:
        dest = tmp_path / "out" / "ckpt"
        dest.parent.mkdir(exist_ok=True)
        if kind == "existing":
            shutil.copytree(tiny_ckpt, dest)
        return dest

    return make


@pytest.fixture(scope="session")
def native_kernels():
    """gpt2port's CPU kernels, built on purpose (once per machine: a cache) for the tests that use them; skipped with
    the reason where they cannot be had."""
    from gpt2port.fast import native

    built = native.kernels()
    if not built.matvec:
        pytest.skip(f"gpt2port's CPU kernels are not available here: {built.why_not}")
    return built
