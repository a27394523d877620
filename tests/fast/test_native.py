"""gpt2port's one-row kernel, fp32 and bf16 (gpt2port/fast/native.py, matvec.c): its numbers against F.linear on every
branch of its loops, where the model uses it, and what happens without a compiler, with a broken cache, a failing
build, a kernel that computes wrong, or the switch off: the products stay on oneDNN (fp32) or F.linear (bf16) and
nothing else changes. The kernels are built on purpose (the native_kernels fixture), never by an import."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpt2port import GPT, GPTConfig
from gpt2port.fast import Settings, accelerate, native
from gpt2port.model import KVCache
from tests.support import ROOT

needs_kernel = pytest.mark.usefixtures("native_kernels")
CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=48, vocab_size=203, n_positions=32)


@needs_kernel
@pytest.mark.parametrize("n", [1, 3, 4, 7, 8, 9, 33, 130])
@pytest.mark.parametrize("k", [1, 5, 16, 17, 48, 770])
def test_equals_f_linear_on_every_shape(n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(1, k, generator=g), torch.randn(n, generator=g)
    for bias in (b, None):
        want = F.linear(x, w, bias)
        got = torch.ops.gpt2port.matvec(x, w, bias)
        assert got.shape == (1, n) and got.dtype == torch.float32  # x's shape, (1, k) -> (1, n)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("n", [1, 3, 4, 7, 9, 130])
@pytest.mark.parametrize("k", [1, 5, 16, 17, 770])
def test_bf16_equals_f_linear_within_a_bf16_step(n, k):
    # the same bf16 numbers multiplied in fp32 (another order of summation) and rounded once: at most a step apart
    g = torch.Generator().manual_seed(n * 1000 + k)
    w, x, b = (torch.randn(*shape, generator=g).bfloat16() for shape in ((n, k), (1, k), (n,)))
    for bias in (b, None):
        want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        got = torch.ops.gpt2port.matvec(x, w, bias)
        assert got.shape == (1, n) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-4)
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=2 ** -7, atol=1e-3)  # PyTorch's own bf16


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_do_not_change_the_numbers(dtype):
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(1001, 767, generator=g).to(dtype), torch.randn(767, generator=g).to(dtype)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(torch.ops.gpt2port.matvec(x, w, None))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@needs_kernel
def test_refuses_what_it_would_read_wrong():
    w = torch.randn(8, 6)
    with pytest.raises(ValueError, match="contiguous"):
        torch.ops.gpt2port.matvec(torch.randn(8), w.t(), None)  # a transposed view
    with pytest.raises(ValueError, match=r"got x \(5,\)"):
        torch.ops.gpt2port.matvec(torch.randn(5), w, None)
    with pytest.raises(ValueError, match=r"one row of k numbers .* got x \(6, 1\)"):
        torch.ops.gpt2port.matvec(torch.randn(6, 1), w, None)  # k numbers, but not a row of them
    assert torch.ops.gpt2port.matvec(torch.randn(1, 1, 6), w, None).shape == (1, 1, 8)
    with pytest.raises(ValueError, match="of one dtype"):
        torch.ops.gpt2port.matvec(torch.randn(6).bfloat16(), w, None)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        torch.ops.gpt2port.matvec(torch.randn(6).half(), w.half(), None)
    assert not native.fits(w.bfloat16(), torch.randn(8))  # a bias of another dtype
    x = torch.randn(12)[::2]  # a strided row is copied, not misread
    torch.testing.assert_close(torch.ops.gpt2port.matvec(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-5)


def logits_one_token(model: GPT) -> torch.Tensor:
    idx = torch.tensor([[5, 17, 101, 3]])
    with torch.inference_mode():
        cache = KVCache(model.config, 1, 8, dtype=model.tok_emb.weight.dtype)
        model(idx[:, :3], cache=cache)
        return model(idx[:, 3:], cache=cache, pos=3, logits_to_keep=1)[0]


def products(fn) -> list[tuple[int, int]]:
    """The (n, k) of every weight fn() hands to gpt2port::matvec, in order (seen by PyTorch's profiler: whichever
    kernel serves the operator, C++ or Python)."""
    with torch.profiler.profile(record_shapes=True) as prof:
        fn()
    return [tuple(e.input_shapes[1]) for e in prof.events() if e.name == "gpt2port::matvec"]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_takes_it_for_one_row_only(monkeypatch, dtype):
    torch.manual_seed(0)
    model = accelerate(GPT(CONFIG).eval().to(dtype), Settings())
    with_kernel = []
    calls = products(lambda: with_kernel.append(logits_one_token(model)))
    C = CONFIG.n_embd
    per_block = [(3 * C, C), (C, C), (4 * C, C), (C, 4 * C)]
    assert calls == per_block * CONFIG.n_layer + [(CONFIG.vocab_size, C)]  # the prefill: none
    accelerate(model, Settings(native=False))
    without = []
    assert products(lambda: without.append(logits_one_token(model))) == []
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(with_kernel[0], without[0], rtol=tolerance, atol=tolerance)


needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C compiler here")


@needs_compiler
@pytest.mark.skipif(sys.platform != "linux", reason="elsewhere the compiler may lack OpenMP")
def test_built_and_in_use_where_a_compiler_is():
    # else every test above would skip, and a kernel the probe refuses would go unnoticed
    assert native.kernels().matvec, native.kernels().why_not


def builds(monkeypatch) -> list:
    """Record every compiler run that builds (not the version query)."""
    runs, real = [], subprocess.run

    def run(cmd, *args, **kwargs):
        if "-shared" in cmd:
            runs.append(cmd)
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(native.subprocess, "run", run)
    return runs


@needs_compiler
def test_built_once_then_taken_from_the_cache(tmp_path, monkeypatch):
    runs = builds(monkeypatch)
    lib, why = native.load(tmp_path, native.compiler())
    assert why is None and lib is not None and len(runs) == 1
    lib, why = native.load(tmp_path, native.compiler())
    assert why is None and lib is not None and len(runs) == 1
    # no temporary left (the lock file stays: it is how concurrent builds take turns)
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [".lock", native.LIBRARY_NAME]


@needs_compiler
def test_a_broken_cached_library_is_built_again(tmp_path, monkeypatch):
    native.load(tmp_path / "a", native.compiler())
    (built,) = (tmp_path / "a").rglob(native.LIBRARY_NAME)
    # the same place in another cache (a loaded library is never written over: its pages are mapped)
    path = tmp_path / "b" / built.relative_to(tmp_path / "a")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a library")
    runs = builds(monkeypatch)
    lib, why = native.load(tmp_path / "b", native.compiler())
    assert why is None and lib is not None and len(runs) == 1
    assert path.read_bytes()[:4] == b"\x7fELF" or sys.platform != "linux"


@needs_compiler
def test_another_cpu_gets_a_build_of_its_own(tmp_path, monkeypatch):
    native.load(tmp_path, native.compiler())
    monkeypatch.setattr(native, "cpu_identity", lambda: "flags: none of the above")
    runs = builds(monkeypatch)
    native.load(tmp_path, native.compiler())
    assert len(runs) == 1 and len(list(tmp_path.rglob(native.LIBRARY_NAME))) == 2


def test_without_a_compiler(tmp_path):
    assert native.load(tmp_path, None) == (None, "no C compiler found (cc, gcc or clang on the PATH, or $CC)")


def test_a_compiler_that_fails(tmp_path):
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo fake 1.0; exit 0; fi\n'
                  'echo "matvec.c:1: error: no such thing" >&2; exit 1\n')
    cc.chmod(0o755)
    lib, why = native.load(tmp_path / "cache", str(cc))
    assert lib is None
    assert why.startswith(f"building matvec.c, attention.c, int4.c, int4_fit.c, layers.c with {cc} failed: "
                          "-O3 -march=native -fopenmp: matvec.c:1:")
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.name != ".lock"]  # nothing half-built


@needs_compiler
def test_a_kernel_that_computes_wrong_is_refused(tmp_path, monkeypatch):
    class Wrong:  # leaves y as it was: not the product
        gpt2port_matvec = gpt2port_matvec_bf16 = staticmethod(lambda *args: None)

    assert not native._agrees(lambda w, x, b, threads, out: native._product(Wrong(), x, w, b, threads, out))
    assert not native._agrees(lambda w, x, b, threads, out: torch.zeros(w.size(0), dtype=w.dtype))
    monkeypatch.setattr(native, "_open", lambda path: Wrong() if path.parent.exists() else None)
    lib, why = native.load(tmp_path, native.compiler())
    assert lib is None and why.endswith("disagrees with F.linear on a probe")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_python_kernel_computes_what_the_cpp_one_does(dtype, native_kernels):
    # the operator's two ways into the library: whichever serves it, the same numbers
    g = torch.Generator().manual_seed(5)
    w, x, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((131, 770), (1, 770), (131,)))
    for bias in (b, None):
        assert torch.equal(native._matvec(native_kernels.lib, x, w, bias), torch.ops.gpt2port.matvec(x, w, bias))
    with pytest.raises(ValueError, match="of one dtype"):
        native._matvec(native_kernels.lib, x.float() if dtype == torch.bfloat16 else x.bfloat16(), w, None)
    with pytest.raises(ValueError, match="contiguous"):
        native._matvec(native_kernels.lib, x, w, b[:-1])  # a bias one short would be read past its end


needs_cxx = pytest.mark.skipif(native.compiler("CXX") is None or sys.platform != "linux", reason="no C++ compiler here")


@needs_kernel
@needs_cxx
def test_the_cpp_kernel_serves_the_operator_where_it_builds():
    # else the Python kernel would serve it unnoticed, a few microseconds slower a product
    assert native.kernels().binding_why_not is None
    built = list(Path(native.cache_dir()).rglob(native.BINDING_NAME))
    assert built and all(p.stat().st_size > 0 for p in built)


def test_a_cpp_compiler_that_fails(tmp_path):
    cxx = tmp_path / "c++"
    cxx.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo fake 1.0; exit 0; fi\n'
                   'echo "native_ops.cpp:1: error: no such header" >&2; exit 1\n')
    cxx.chmod(0o755)
    why = native.bind(tmp_path / "cache", str(cxx), type("Lib", (), {"_name": "/nowhere/lib.so"})())
    assert why.startswith(f"building native_ops.cpp and replay.cpp with {cxx} failed: -O2 -std=c++20")
    assert "; -O2 -std=c++17" in why and why.endswith("native_ops.cpp:1: error: no such header")
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.name != ".lock"]  # nothing half-built
    assert native.bind(tmp_path, None, None).startswith("no C++ compiler found")


FIRST_CALLS = """
import sys, torch
from gpt2port import GPT, GPTConfig
model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=11, n_positions=8)).eval()
with torch.inference_mode():
    model(torch.tensor([[1]]))  # a plain model's first forward, one row: nothing is built or registered
ops = lambda: sorted(op for op in torch._C._dispatch_get_all_op_names() if op.startswith("gpt2port::"))
print(ops(), "gpt2port.fast" in sys.modules)
from gpt2port.fast import native
built = native.kernels()
w, x, keys, values = torch.randn(70, 33), torch.randn(33), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)
print(ops(), torch.allclose(torch.ops.gpt2port.matvec(x, w, None), w @ x, rtol=1e-5, atol=1e-5))
print(built.attend_one, built.binding_why_not)
"""


def first_calls(env: dict) -> tuple[list[str], str]:
    """A fresh process: a plain model's forward, then the kernels asked for (stdout lines, stderr)."""
    proc = subprocess.run([sys.executable, "-c", FIRST_CALLS], env={**os.environ, **env}, capture_output=True,
                          text=True, check=True, cwd=ROOT)
    return proc.stdout.splitlines(), proc.stderr


OPERATORS = ("['gpt2port::attend_one', 'gpt2port::attend_one.at', 'gpt2port::dequantize_int4', 'gpt2port::gelu_tanh', "
             "'gpt2port::layer_norm', 'gpt2port::matvec', 'gpt2port::matvec_int4', 'gpt2port::replay_free', "
             "'gpt2port::replay_make', 'gpt2port::replay_run', 'gpt2port::round_int4'] True")


@needs_kernel
@needs_cxx
def test_nothing_is_built_or_registered_until_asked_for(tmp_path):
    out, err = first_calls({"GPT2PORT_NATIVE_CACHE": str(native.cache_dir())})
    assert out == ["[] False", OPERATORS, "True None"]
    assert err == ""  # from the cache: no build, no message
    out, err = first_calls({"GPT2PORT_NATIVE_CACHE": str(tmp_path)})  # an empty cache: built, and said so once
    assert out[1:] == [OPERATORS, "True None"]
    said = err.splitlines()  # the build announced, then its measured time
    assert said[0] == native.BUILD_MESSAGE and re.fullmatch(r"gpt2port: CPU kernels built in \d+\.\d s", said[1])
    assert len(said) == 2, err


@needs_kernel
def test_without_a_cpp_compiler_the_python_kernel_serves(tmp_path):
    why = "no C++ compiler found (c++, g++ or clang++ on the PATH, or $CXX)"
    out, _ = first_calls({"CXX": str(tmp_path / "no-such-compiler")})
    assert out[1:] == [OPERATORS, f"False {why}"]


def test_processes_building_at_once_build_once(tmp_path):
    """N processes (torchrun ranks) starting together on an empty cache: one compiler run per library, the others
    wait on the lock and load what it built."""
    code = ("import sys, subprocess\n"
            "from gpt2port.fast import native\n"
            "real = subprocess.run\n"
            "def run(cmd, *a, **k):\n"
            "    if '-shared' in cmd: print('built', flush=True)\n"
            "    return real(cmd, *a, **k)\n"
            "native.subprocess.run = run\n"
            "print(native.kernels().matvec)\n")
    env = {**os.environ, "GPT2PORT_NATIVE_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT) for _ in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    if native.compiler() is None:
        pytest.skip("no C compiler here")
    assert all(o.splitlines()[-1] == "True" for o, _ in outs), outs
    assert sum(o.count("built") for o, _ in outs) == 2  # the C library and the C++ operators, once each
    assert sum(e.count(native.BUILD_MESSAGE) for _, e in outs) == 1
    assert sum(e.count("CPU kernels built in") for _, e in outs) == 1


@needs_kernel
def test_verbose_says_when_products_go_through_python(monkeypatch):
    from gpt2port.fast.speed import decode_report

    model = GPT(CONFIG).eval()
    monkeypatch.setattr("gpt2port.fast.speed.matvec_bandwidth", lambda device: 1e10)
    assert not any("through Python" in line for line in decode_report(model, "cpu", 100.0))
    built = native.kernels()
    monkeypatch.setattr(native, "kernels", lambda: native.Kernels(
        built.lib, None, "no C++ compiler found (c++, g++ or clang++ on the PATH, or $CXX)"))
    assert decode_report(model, "cpu", 100.0)[-1] == ("gpt2port's one-row kernel is reached through Python, a few us "
                                                      "slower a product: no C++ compiler found (c++, g++ or clang++ "
                                                      "on the PATH, or $CXX)")


WITHOUT_KERNELS = """
import torch
from gpt2port import GPT, GPTConfig
from gpt2port.fast import native
from gpt2port.generate import generate
torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=16)).eval()
report = []
print(generate(model, [[1, 2, 3]], 6, temperature=0, stop_token=None, report=report) ==
      generate(model, [[1, 2, 3]], 6, temperature=0, stop_token=None, fast=__import__("gpt2port.fast").fast.OFF))
print(native.kernels().why_not)
print(report[0])
"""


def test_without_a_compiler_generation_runs_on_pytorchs_kernels(tmp_path):
    """The build failing (no compiler here) costs speed only: generate runs, and says what it ran on."""
    env = {**os.environ, "CC": str(tmp_path / "no-cc"), "CXX": str(tmp_path / "no-cxx"),
           "GPT2PORT_NATIVE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", WITHOUT_KERNELS], env=env, capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["True", "no C compiler found (cc, gcc or clang on the PATH, or $CC)",
                                        "the model's forward; "
                                        "attention on SDPA (no C compiler found (cc, gcc or clang on the PATH, or "
                                        "$CC))"]


@pytest.mark.parametrize("load, said", [(0.0, False), (10000.0, True)])
def test_doctor_says_when_the_machine_is_busy(monkeypatch, load, said):
    from gpt2port.fast import doctor

    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    note = doctor.busy()
    assert bool(note) == said
    if said:
        assert "busy (load average 10000.0 on " in note and "lower than the machine gives when quiet" in note


def test_doctor_builds_and_reports(tmp_path, monkeypatch, capsys):
    from click.testing import CliRunner

    from gpt2port.cli import main

    monkeypatch.setattr("gpt2port.fast.doctor.matvec_bandwidth", lambda device: 12.3e9)  # the probe takes seconds
    r = CliRunner().invoke(main, ["doctor"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()  # stderr: the build's one line, where it built
    assert lines[0].startswith(f"torch {torch.__version__}; {torch.get_num_threads()} threads")
    built = native.kernels()
    assert lines[1].startswith("gpt2port's CPU kernels: " + ("built" if built.attend_one else
                                                             "one-row" if built.matvec else "not available"))
    bandwidth = next(line for line in lines if line.startswith("memory bandwidth"))
    assert bandwidth.startswith("memory bandwidth (one-row product, 256 MB weight): 12.3 GB/s")
    assert any(line.startswith("generate on the CPU, float32: decode products on ") for line in lines)
    step = next(line for line in lines if line.startswith("decode steps of one row on the CPU: the model's forward, "))
    assert step.endswith("replayed from C++ after its first step (GPT2PORT_COMPILE=1 compiles it instead)"
                         if built.attend_one else "called from Python each step (a replay needs gpt2port's attention "
                         "kernel)"), step
    assert lines[-1].startswith("CUDA: ")
