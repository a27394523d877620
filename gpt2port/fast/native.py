"""gpt2port's own CPU kernels for a decode step, fp32 and bf16, built on purpose with the machine's C compiler and
offered to PyTorch as operators: torch.ops.gpt2port.matvec, one row times a weight (matvec.c),
torch.ops.gpt2port.attend_one, attention for one new token of one sequence (attention.c), and the 4-bit weights'
products of gpt2port.quant4 (int4.c: matvec_int4, dequantize_int4, round_int4; fast/int4.py checks them).

Why: a decode step is ~50 one-row products, and the kernels PyTorch ships stream GPT-2's narrow weights well below
what the memory gives (matvec.c says why and how its loops differ); attention for one token is small work that
PyTorch's kernel, built for many queries, spends a noticeable share of a step setting up (attention.c). They are
accelerators, never a requirement: without a C compiler with OpenMP, with Settings(native=False) or
GPT2PORT_NATIVE=0, or if the built library disagrees with F.linear on a probe, every product stays where it was and
`Kernels.why_not` says why.

Nothing is built or registered at import. `kernels()` builds (once per machine, with one line on stderr when a build
starts, under a file lock so that N processes started together build once) or loads the cached build, registers the
operators, and says what it got. `gpt2port doctor` calls it; so does gpt2port.fast.accelerate, which is where
`generate` asks for speed. A plain GPT never builds anything.

The operators' kernels are native_ops.cpp (and replay.cpp, the replay of a recorded forward: fast/replay.py), built
against the running PyTorch's headers with the machine's C++ compiler and linked to the library. Where that cannot
be built, a kernel in Python serves gpt2port::matvec through ctypes, a few us slower a product, and attention stays on
PyTorch's (`Kernels.binding_why_not`).

Builds live in a cache (GPT2PORT_NATIVE_CACHE, else $XDG_CACHE_HOME/gpt2port/native, else ~/.cache/gpt2port/native),
under names derived from the sources, the compiler, the flags and the CPU (and, for the C++ kernels, PyTorch's
version): a library built with -march=native for another CPU would crash on this one. The build is hand-made rather
than torch.utils.cpp_extension's: the library is C (OpenMP, -march=native, built with cc, not as C++), and
cpp_extension needs ninja, which gpt2port does not otherwise depend on.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# The library's C files, and the header they share (part of what a build is named after).
SOURCES = tuple(Path(__file__).with_name(name) for name in ("matvec.c", "attention.c", "int4.c", "int4_fit.c",
                                                            "layers.c"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("vectors.h", "int4.h"))
LIBRARY_NAME = "libgpt2port_native.so"
BINDING_SOURCES = tuple(Path(__file__).with_name(name) for name in ("native_ops.cpp", "replay.cpp"))
BINDING_NAME = "libgpt2port_ops.so"
# Tried in order: the machine's own vector instructions, then the compiler's defaults.
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-fopenmp"])
# PyTorch's headers want C++17 or later; C++20 spares warnings from recent ones.
BINDING_FLAG_SETS = (["-O2", "-std=c++20"], ["-O2", "-std=c++17"])
BUILD_TIMEOUT_S = 120
BUILD_MESSAGE = "gpt2port: building gpt2port's CPU kernels, once per machine (two compiler runs, 10-60 s)"
# What it multiplies: the dtype of weight, activations, bias and result alike -> the library's function for it
FUNCTIONS = {torch.float32: "gpt2port_matvec", torch.bfloat16: "gpt2port_matvec_bf16"}


@dataclass(frozen=True)
class Kernels:
    """What `kernels()` got: the library (None where it could not be had, `why_not` says why) and whether the C++
    operators serve it (`binding_why_not` None) or only matvec's Python kernel (attention then stays PyTorch's)."""
    lib: ctypes.CDLL | None
    why_not: str | None
    binding_why_not: str | None

    @property
    def matvec(self) -> bool:
        return self.lib is not None

    @property
    def attend_one(self) -> bool:
        return self.lib is not None and self.binding_why_not is None


@functools.cache
def kernels() -> Kernels:
    """Build (or load the cached build of) the library and its operators, once per process, and register
    torch.ops.gpt2port.matvec / attend_one where they work. Never raises: a failure is reported in the result."""
    cache, announced = cache_dir(), _announce.cache_info().currsize
    # Both builds under one hold of the cache's lock: of N processes starting together, one builds the library and
    # its operators (and says so once); the others wait, then load both.
    with locked(cache / ".lock", create_parent=True):
        lib, why_not = load(cache, compiler(), lock=False)
        if lib is None:
            return Kernels(None, why_not, why_not)
        _define_ops()
        binding_why_not = bind(cache, compiler("CXX"), lib, lock=False)
    if _announce.cache_info().currsize > announced:  # built here: the time it took, measured
        print(f"gpt2port: CPU kernels built in {time.perf_counter() - _announce():.1f} s", file=sys.stderr, flush=True)
    if binding_why_not is not None:
        with warnings.catch_warnings():  # over a C++ kernel that loaded but failed its probe: meant to replace it
            warnings.simplefilter("ignore")
            _OPS.impl("matvec", functools.partial(_matvec, lib), "CPU")
    return Kernels(lib, None, binding_why_not)


_OPS: torch.library.Library | None = None


def _define_ops() -> None:
    """Declare the operators (their CPU kernels come from native_ops.cpp or _matvec), with shape-only Meta kernels
    for whatever traces a model without running it."""
    global _OPS
    _OPS = torch.library.Library("gpt2port", "DEF")
    _OPS.define("matvec(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
    _OPS.define("attend_one(Tensor qkv, Tensor(a!) keys, Tensor(b!) values, int length, float? scale) -> Tensor")
    # the position as a one-element tensor: what a captured forward replays with a new value each step
    _OPS.define("attend_one.at(Tensor qkv, Tensor(a!) keys, Tensor(b!) values, Tensor length, float? scale) -> Tensor")
    _OPS.impl("matvec", lambda x, weight, bias: weight.new_empty(*x.shape[:-1], weight.size(0)), "Meta")
    for name in ("attend_one", "attend_one.at"):
        _OPS.impl(name, lambda qkv, keys, values, length, scale: qkv.new_empty(*qkv.shape[:-1], qkv.size(-1) // 3),
                  "Meta")
    # 4- to 8-bit weights (int4.c, gpt2port.quant4): packed rows (n, k * bits / 8 + k / 16 + 4) uint8 of k numbers
    _OPS.define("matvec_int4(Tensor x, Tensor packed, Tensor? bias, int k) -> Tensor")
    _OPS.define("dequantize_int4(Tensor packed, int k) -> Tensor")
    _OPS.impl("matvec_int4", lambda x, packed, bias, k: x.new_empty(*x.shape[:-1], packed.size(0)), "Meta")
    _OPS.impl("dequantize_int4", lambda packed, k: packed.new_empty(packed.size(0), k, dtype=torch.float32), "Meta")
    # activations as the int4 products take them, rounded to 8 bits per group of 32 (gpt2port.quant4.round_activations)
    _OPS.define("round_int4(Tensor x) -> Tensor")
    _OPS.impl("round_int4", lambda x: x.new_empty(x.shape), "Meta")
    # a decode step's small layers (layers.c): LayerNorm over the last dimension, GPT-2's tanh GELU
    _OPS.define("layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor")
    _OPS.define("gelu_tanh(Tensor x) -> Tensor")
    _OPS.impl("layer_norm", lambda x, weight, bias, eps: x.new_empty(x.shape), "Meta")
    _OPS.impl("gelu_tanh", lambda x: x.new_empty(x.shape), "Meta")
    _OPS.define("replay_make(str program, Tensor[] constants) -> int")  # fast/replay.py; never traced: no Meta
    _OPS.define("replay_run(int program, Tensor[] inputs) -> Tensor")
    _OPS.define("replay_free(int program) -> ()")


def _matvec(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The operator's kernel in Python, where the C++ one (native_ops.cpp) cannot be had: x one row (1, ..., k),
    weight (n, k) and bias (n,) as fits() wants them, all of one dtype -> (1, ..., n)."""
    if x.dim() < 1 or x.size(-1) != weight.size(-1) or x.numel() != weight.size(-1) or x.dtype != weight.dtype or \
            x.device.type != "cpu" or not fits(weight, bias):
        raise ValueError(f"gpt2port::matvec takes one row of k numbers (1, ..., k) and a contiguous (n, k) weight of "
                         f"one dtype, fp32 or bf16; got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
                         f"{weight.dtype}")
    return _product(lib, x, weight, bias, torch.get_num_threads())


def fits(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the one-row kernel multiplies by this weight (and bias): fp32 or bf16 on the CPU, contiguous (a
    transposed view would be read in the wrong order), a bias of its rows' count and dtype."""
    return weight.dtype in FUNCTIONS and weight.device.type == "cpu" and weight.dim() == 2 and \
        weight.is_contiguous() and (bias is None or (bias.dtype == weight.dtype and bias.device.type == "cpu" and
                                                     bias.is_contiguous() and bias.numel() == weight.size(0)))


def attends(keys: torch.Tensor) -> bool:
    """Whether gpt2port::attend_one computes attention over this cache of one sequence's keys (1, H, T, D): fp32 or
    bf16 on the CPU, contiguous (the operator must also be built: Kernels.attend_one)."""
    return keys.dtype in FUNCTIONS and keys.device.type == "cpu" and keys.dim() == 4 and keys.size(0) == 1 and \
        keys.is_contiguous()


def _product(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int,
             y: torch.Tensor | None = None) -> torch.Tensor:
    """The library's product of checked arguments, into y if given; bf16's x is handed over widened to fp32."""
    n, k = weight.shape
    row = x.reshape(k).contiguous() if x.dtype == torch.float32 else x.reshape(k).float()
    y = torch.empty(*x.shape[:-1], n, dtype=weight.dtype) if y is None else y
    getattr(lib, FUNCTIONS[weight.dtype])(weight.data_ptr(), row.data_ptr(), None if bias is None else bias.data_ptr(),
                                          y.data_ptr(), n, k, threads)
    return y


def compiler(variable: str = "CC") -> str | None:
    """The C compiler to build with: $CC if set, else the first of cc, gcc, clang on the PATH; with "CXX" the C++
    compiler likewise: $CXX, else c++, g++, clang++."""
    names = ("cc", "gcc", "clang") if variable == "CC" else ("c++", "g++", "clang++")
    if os.environ.get(variable):
        return shutil.which(os.environ[variable])
    return next((path for name in names if (path := shutil.which(name))), None)


def cache_dir() -> Path:
    if os.environ.get("GPT2PORT_NATIVE_CACHE"):
        return Path(os.environ["GPT2PORT_NATIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gpt2port" / "native"


def load(cache: Path, cc: str | None, lock: bool = True) -> tuple[ctypes.CDLL | None, str | None]:
    """(the library, None), built into `cache` if not there yet, or (None, why not). lock=False: the caller holds
    the cache's lock."""
    if cc is None:
        return None, "no C compiler found (cc, gcc or clang on the PATH, or $CC)"
    source = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    version = _run([cc, "--version"])
    if version is None:
        return None, f"the C compiler {cc} does not run"
    errors = []
    for flags in FLAG_SETS:
        path = cache / _key(source, cc, version, flags) / LIBRARY_NAME
        lib = _open(path)
        if lib is None:
            error = _build([cc, *flags, "-shared", "-fPIC", *map(str, SOURCES), "-lm"], path, lock)
            if error is not None:
                errors.append(f"{' '.join(flags)}: {error}")
                continue
            lib = _open(path)
        if lib is None:
            errors.append(f"{path} does not load")
            continue
        if not _agrees(lambda w, x, b, threads, out: _product(lib, x, w, b, threads, out)):
            return None, f"{path} disagrees with F.linear on a probe"
        return lib, None
    return None, f"building {', '.join(p.name for p in SOURCES)} with {cc} failed: " + "; ".join(errors)


def bind(cache: Path, cxx: str | None, lib: ctypes.CDLL, lock: bool = True) -> str | None:
    """Register the operator's C++ kernel (native_ops.cpp, linked to `lib`), built into `cache` against this PyTorch
    if not there yet; None once it serves the operator, else why not. Once per process: a kernel registered stays."""
    if cxx is None:
        return "no C++ compiler found (c++, g++ or clang++ on the PATH, or $CXX)"
    version = _run([cxx, "--version"])
    if version is None:
        return f"the C++ compiler {cxx} does not run"
    torch_dir, errors = Path(torch.__file__).parent, []
    source = b"\0".join(path.read_bytes() for path in BINDING_SOURCES)
    for flags in BINDING_FLAG_SETS:
        flags = [*flags, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]
        # PyTorch's version in the key: the C++ kernel is built against its headers and calls into its libraries
        path = cache / _key(source, cxx, version, flags, lib._name, torch.__version__,
                            str(torch.version.git_version)) / BINDING_NAME
        if not path.is_file():
            error = _build([cxx, *flags, "-shared", "-fPIC", "-I", str(torch_dir / "include"),
                            *map(str, BINDING_SOURCES), lib._name, "-L", str(torch_dir / "lib"), "-lc10",
                            "-ltorch_cpu"], path, lock)
            if error is not None:
                errors.append(f"{' '.join(flags)}: {error}")
                continue
        try:
            torch.ops.load_library(str(path))
        except OSError:
            path.unlink(missing_ok=True)  # a broken or foreign file: built again next time
            errors.append(f"{path} does not load")
            continue
        if not _agrees(lambda w, x, b, threads, out: torch.ops.gpt2port.matvec(x, w, b)) or not _attends_right() \
                or not _layers_right():
            return f"{path} disagrees with F.linear, PyTorch's attention, layer_norm or GELU on a probe"
        return None
    return f"building {' and '.join(p.name for p in BINDING_SOURCES)} with {cxx} failed: " + "; ".join(errors)


def _key(source: bytes, cc: str, version: str, flags: list[str], *more: str) -> str:
    """A name for one build: what it was built from, by what, for which CPU (and `more` it depends on)."""
    h = hashlib.sha256(source)
    for part in (cc, version, " ".join(flags), platform.machine(), cpu_identity(), *more):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:20]


def cpu_identity() -> str:
    """The CPU's model and feature flags (what -march=native compiles for), as far as the system tells."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    return "\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in wanted}))


def _open(path: Path) -> ctypes.CDLL | None:
    if not path.is_file():
        return None
    try:
        lib = ctypes.CDLL(str(path))
        functions = {dtype: getattr(lib, name) for dtype, name in FUNCTIONS.items()}
    except (OSError, AttributeError):
        path.unlink(missing_ok=True)  # a broken or foreign file: built again next time
        return None
    for dtype, fn in functions.items():
        fn.restype = None if dtype == torch.float32 else ctypes.c_int  # bf16's says whether it had its buffer
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    return lib


def _build(command: list[str], path: Path, lock: bool = True) -> str | None:
    """Run the compiler `command` with its output in a temporary file beside `path`, then rename it there, holding
    the cache's lock (unless the caller holds it: lock=False): of N processes starting together (torchrun ranks) one
    builds, the others then find its file. The error's last line, or None."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot write the cache {path.parent}: {e.strerror}"
    with locked(path.parent.parent / ".lock") if lock else contextlib.nullcontext():
        if path.is_file():  # built by another process while this one waited
            return None
        _announce()
        try:
            fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=path.parent)
            os.close(fd)
        except OSError as e:
            return f"cannot write the cache {path.parent}: {e.strerror}"
        try:
            proc = subprocess.run([*command, "-o", tmp], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if proc.returncode != 0:
                lines = (proc.stderr or proc.stdout).strip().splitlines()
                return lines[-1] if lines else f"exit status {proc.returncode}"
            os.replace(tmp, path)
            return None
        except (OSError, subprocess.TimeoutExpired) as e:
            return str(e)
        finally:
            Path(tmp).unlink(missing_ok=True)


@functools.cache
def _announce() -> float:
    """One line on stderr when this process starts building (a user waiting is told why, once); when it started."""
    print(BUILD_MESSAGE, file=sys.stderr, flush=True)
    return time.perf_counter()


@contextlib.contextmanager
def locked(path: Path, create_parent: bool = False):
    """An exclusive lock on `path` for the block (flock; where there is none, no lock: the rename above still keeps
    a half-written library from ever being loaded)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    try:
        if create_parent:
            path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _run(cmd: list[str]) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _agrees(product) -> bool:
    """A kernel, product(weight, x, bias, threads, out) -> y (out: NaNs it may write into), against F.linear on
    shapes that exercise its every branch (runs of rows and rows left over, whole and partial vectors of a row, with
    and without bias), in each dtype, at 1 and 2 threads, from a private generator. bf16 against the same numbers
    multiplied in fp32 and rounded once, within a bf16 step (the sums' order differs)."""
    g = torch.Generator().manual_seed(0)
    for dtype in FUNCTIONS:
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        for n, k, with_bias in ((37, 50, True), (8, 16, False), (3, 5, True), (130, 768, False)):
            w, x, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((n, k), (k,), (n,)))
            bias = b if with_bias else None
            want = F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(dtype)
            for threads in (1, 2):
                y = product(w, x, bias, threads, torch.full((n,), float("nan"), dtype=dtype))  # none written: NaN
                if y.shape != want.shape or not torch.allclose(y.float(), want.float(), rtol=tolerance,
                                                                atol=tolerance):
                    return False
    return True


def _attends_right() -> bool:
    """gpt2port::attend_one against scaled_dot_product_attention, in each dtype, on head sizes of whole and partial
    vectors, at the first position and a later one, with the default scale and another: its output, and the new
    key and value in the cache, from a private generator."""
    g = torch.Generator().manual_seed(0)
    for dtype in FUNCTIONS:
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        for H, D, T, length, scale in ((3, 24, 8, 0, None), (2, 64, 9, 6, None), (2, 17, 5, 4, 1.0)):
            keys, values = (torch.randn(1, H, T, D, generator=g).to(dtype) for _ in range(2))
            qkv = torch.randn(3 * H * D, generator=g).to(dtype)
            q, k, v = qkv.view(3, 1, H, 1, D).unbind(0)
            want_keys, want_values = keys.clone(), values.clone()
            want_keys[:, :, length], want_values[:, :, length] = k[:, :, 0], v[:, :, 0]
            want = F.scaled_dot_product_attention(q.float(), want_keys[:, :, :length + 1].float(),
                                                  want_values[:, :, :length + 1].float(), scale=scale).view(-1)
            at = (keys.clone(), values.clone())
            y = torch.ops.gpt2port.attend_one(qkv, keys, values, length, scale)
            y_at = torch.ops.gpt2port.attend_one.at(qkv, *at, torch.tensor([length]), scale)
            if not (torch.equal(y, y_at) and torch.equal(at[0], keys) and torch.equal(at[1], values)):
                return False
            if not (torch.equal(keys, want_keys) and torch.equal(values, want_values) and y.dtype == dtype and
                    torch.allclose(y.float(), want, rtol=tolerance, atol=tolerance)):
                return False
    return True


def _layers_right() -> bool:
    """gpt2port::layer_norm and gelu_tanh against F.layer_norm and F.gelu(approximate="tanh"), from a private
    generator: rows of whole and partial vectors, with weight and bias and without, at the scales of a trained
    model's activations (std ~2, a few outliers), and a row holding NaN and infinities."""
    g = torch.Generator().manual_seed(0)
    for rows, n in ((1, 768), (3, 37), (2, 5)):
        x = torch.randn(rows, n, generator=g) * 2
        x[:, 0] = 40.0  # an outlier channel
        w, b = 1 + 0.3 * torch.randn(n, generator=g), torch.randn(n, generator=g)
        for weight, bias in ((w, b), (None, None)):
            if not torch.allclose(torch.ops.gpt2port.layer_norm(x, weight, bias, 1e-5),
                                  F.layer_norm(x, (n,), weight, bias, 1e-5), rtol=1e-5, atol=1e-5):
                return False
        if not torch.allclose(torch.ops.gpt2port.gelu_tanh(x), F.gelu(x, approximate="tanh"), rtol=1e-5, atol=1e-6):
            return False
    edges = torch.tensor([float("nan"), float("inf"), -float("inf"), -1e20, 1e20, -0.0, 0.0, -6.0, 3.0])
    return torch.allclose(torch.ops.gpt2port.gelu_tanh(edges), F.gelu(edges, approximate="tanh"), atol=1e-6,
                          equal_nan=True)
