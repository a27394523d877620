"""gpt2port's one-row product (matvec.c), fp32 and bf16, built on first use with the machine's C compiler and offered
to PyTorch as the operator torch.ops.gpt2port.matvec, which the model's Linear layers and the scripted decode step
call for one row of activations on the CPU.

Why: a decode step is ~50 one-row products, and on the CPUs measured the kernels PyTorch ships stream GPT-2's narrow
weights at ~70% of what the memory gives (matvec.c says why and how its loops differ), bf16 ones at ~60%; this one
comes within a few percent of it in both. It is an accelerator, never a requirement: without a C compiler with
OpenMP, with GPT2PORT_NATIVE=0 or `ENABLED = False`, or if the built library disagrees with F.linear on a probe,
every product stays where it was (fp32 on oneDNN, bf16 on F.linear) and `why_not()` says why.

The operator's kernel is matvec_op.cpp, built against the running PyTorch's headers with the machine's C++ compiler
and linked to the library: it checks the arguments and calls the library directly. Where that cannot be built, a
kernel in Python does the same through ctypes, ~3 us slower a product (`binding_why_not()` says why).

Both are built once per machine into a cache (GPT2PORT_NATIVE_CACHE, else $XDG_CACHE_HOME/gpt2port/native, else
~/.cache/gpt2port/native), under names derived from the source, the compiler, the flags and the CPU (and, for the C++
kernel, PyTorch's version): a library built with -march=native for another CPU would crash on this one, so one is
never loaded on the wrong CPU. Building takes ~1 s and ~5 s; a failed build or a broken cached file costs only speed.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("matvec.c")
LIBRARY_NAME = "libgpt2port_matvec.so"
BINDING_SOURCE, BINDING_NAME = Path(__file__).with_name("matvec_op.cpp"), "libgpt2port_matvec_op.so"
# Tried in order: the machine's own vector instructions, then the compiler's defaults.
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-fopenmp"])
# PyTorch's headers want C++17 or later; C++20 spares warnings from recent ones.
BINDING_FLAG_SETS = (["-O2", "-std=c++20"], ["-O2", "-std=c++17"])
BUILD_TIMEOUT_S = 120
ENABLED = os.environ.get("GPT2PORT_NATIVE", "1") != "0"
# What it multiplies: the dtype of weight, activations, bias and result alike -> the library's function for it
FUNCTIONS = {torch.float32: "gpt2port_matvec", torch.bfloat16: "gpt2port_matvec_bf16"}

_why_not: str | None = None
_binding_why_not: str | None = None

# The operator, declared whether or not the library builds: the scripted decode step names it in a branch that
# TorchScript compiles either way. Its kernel is only ever called once available() has said yes.
_OPS = torch.library.Library("gpt2port", "DEF")
_OPS.define("matvec(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def _matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The operator's kernel in Python, where the C++ one (matvec_op.cpp) cannot be had: x k numbers (any shape),
    weight (n, k) and bias (n,) as takes() wants them, all of one dtype -> (n,)."""
    if x.numel() != weight.size(-1) or x.dtype != weight.dtype or x.device.type != "cpu" or not _fits(weight, bias):
        raise ValueError(f"gpt2port::matvec takes k numbers and a contiguous (n, k) weight of one dtype, fp32 or "
                         f"bf16; got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    lib = library()
    if lib is None:
        raise RuntimeError(f"gpt2port::matvec is not available: {why_not()}")
    return _product(lib, x, weight, bias, torch.get_num_threads())


def _product(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int,
             y: torch.Tensor | None = None) -> torch.Tensor:
    """The library's product of checked arguments, into y if given; bf16's x is handed over widened to fp32."""
    n, k = weight.shape
    row = x.reshape(k).contiguous() if x.dtype == torch.float32 else x.reshape(k).float()
    y = torch.empty(n, dtype=weight.dtype) if y is None else y
    getattr(lib, FUNCTIONS[weight.dtype])(weight.data_ptr(), row.data_ptr(), None if bias is None else bias.data_ptr(),
                                          y.data_ptr(), n, k, threads)
    return y


# Shapes only, for whatever traces the model without running it (torch.compile, meta-device models)
_OPS.impl("matvec", lambda x, weight, bias: weight.new_empty(weight.size(0)), "Meta")


def available() -> bool:
    """Whether one-row products take gpt2port's kernel now: switched on, built (or cached) and probed right."""
    return ENABLED and library() is not None


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the product x @ weight.T (+ bias) is one the kernel computes: one row of the weight's dtype, on a
    weight it takes."""
    return x.numel() == weight.size(1) and x.dtype == weight.dtype and takes(weight, bias)


def takes(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel multiplies by this weight (and bias): fp32 or bf16 on the CPU, contiguous (a transposed
    view would be read in the wrong order), a bias of its rows' count and dtype, and the kernel available."""
    return _fits(weight, bias) and available()


def _fits(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return weight.dtype in FUNCTIONS and weight.device.type == "cpu" and weight.dim() == 2 and \
        weight.is_contiguous() and (bias is None or (bias.dtype == weight.dtype and bias.device.type == "cpu" and
                                                     bias.is_contiguous() and bias.numel() == weight.size(0)))


def why_not() -> str | None:
    """Why the kernel is not in use (switched off, no compiler, build or probe failed), or None when it is."""
    if not ENABLED:
        return "switched off (GPT2PORT_NATIVE=0 or gpt2port.native.ENABLED = False)"
    return None if library() is not None else _why_not


def binding_why_not() -> str | None:
    """Why the operator reaches the kernel through Python (ctypes) rather than its C++ kernel (matvec_op.cpp), which
    saves each product a few microseconds; None when the C++ one serves it (or the kernel is not in use at all)."""
    return None if why_not() is not None else _binding_why_not


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library, once per process (None where it cannot be had; see why_not), with the operator's kernel
    registered: the C++ one where it builds and agrees, else the Python one."""
    global _why_not, _binding_why_not
    lib, _why_not = load(cache_dir(), compiler())
    _binding_why_not = _why_not if lib is None else bind(cache_dir(), compiler("CXX"), lib)
    if _binding_why_not is not None:
        with warnings.catch_warnings():  # over a C++ kernel that loaded but failed its probe: meant to replace it
            warnings.simplefilter("ignore")
            _OPS.impl("matvec", _matvec, "CPU")
    return lib


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


def load(cache: Path, cc: str | None) -> tuple[ctypes.CDLL | None, str | None]:
    """(the library, None), built into `cache` if not there yet, or (None, why not)."""
    if cc is None:
        return None, "no C compiler found (cc, gcc or clang on the PATH, or $CC)"
    source = SOURCE.read_bytes()
    version = _run([cc, "--version"])
    if version is None:
        return None, f"the C compiler {cc} does not run"
    errors = []
    for flags in FLAG_SETS:
        path = cache / _key(source, cc, version, flags) / LIBRARY_NAME
        lib = _open(path)
        if lib is None:
            error = _build([cc, *flags, "-shared", "-fPIC", str(SOURCE)], path)
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
    return None, f"building {SOURCE.name} with {cc} failed: " + "; ".join(errors)


def bind(cache: Path, cxx: str | None, lib: ctypes.CDLL) -> str | None:
    """Register the operator's C++ kernel (matvec_op.cpp, linked to `lib`), built into `cache` against this PyTorch
    if not there yet; None once it serves the operator, else why not. Once per process: a kernel registered stays."""
    if cxx is None:
        return "no C++ compiler found (c++, g++ or clang++ on the PATH, or $CXX)"
    version = _run([cxx, "--version"])
    if version is None:
        return f"the C++ compiler {cxx} does not run"
    torch_dir, source, errors = Path(torch.__file__).parent, BINDING_SOURCE.read_bytes(), []
    for flags in BINDING_FLAG_SETS:
        flags = [*flags, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
        # PyTorch's version in the key: the C++ kernel is built against its headers and calls into its libraries
        path = cache / _key(source, cxx, version, flags, lib._name, torch.__version__,
                            str(torch.version.git_version)) / BINDING_NAME
        if not path.is_file():
            error = _build([cxx, *flags, "-shared", "-fPIC", "-I", str(torch_dir / "include"), str(BINDING_SOURCE),
                            lib._name, "-L", str(torch_dir / "lib"), "-lc10", "-ltorch_cpu"], path)
            if error is not None:
                errors.append(f"{' '.join(flags)}: {error}")
                continue
        try:
            torch.ops.load_library(str(path))
        except OSError:
            path.unlink(missing_ok=True)  # a broken or foreign file: built again next time
            errors.append(f"{path} does not load")
            continue
        if not _agrees(lambda w, x, b, threads, out: torch.ops.gpt2port.matvec(x, w, b)):
            return f"{path} disagrees with F.linear on a probe"
        return None
    return f"building {BINDING_SOURCE.name} with {cxx} failed: " + "; ".join(errors)


def _key(source: bytes, cc: str, version: str, flags: list[str], *more: str) -> str:
    """A name for one build: what it was built from, by what, for which CPU (and `more` it depends on)."""
    h = hashlib.sha256(source)
    for part in (cc, version, " ".join(flags), platform.machine(), _cpu_identity(), *more):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:20]


def _cpu_identity() -> str:
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


def _build(command: list[str], path: Path) -> str | None:
    """Run the compiler `command` with its output in a temporary file beside `path`, then rename it there (two
    processes building at once each rename a whole library); the error's last line, or None."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
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


def _run(cmd: list[str]) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _agrees(product) -> bool:
    """A kernel, product(weight, x, bias, threads, out) -> y (out: NaNs it may write into), against F.linear on shapes that exercise its every branch
    (runs of rows and rows left over, whole and partial vectors of a row, with and without bias), in each dtype, at 1
    and 2 threads, from a private generator. bf16 against the same numbers multiplied in fp32 and rounded once,
    within a bf16 step (the sums' order differs)."""
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
