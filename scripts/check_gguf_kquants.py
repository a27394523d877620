"""Proof by llama.cpp itself that gpt2port's quantized GGUF exports are byte for byte what llama.cpp writes.

    python -m scripts.check_gguf_kquants [--widths 768,1600] [--layers 4] [--types q4_k_m,...] [--rows 256]

Two checks, for each type and width:
  blocks: gpt2port's quantizer (gpt2port/formats/gguf_quants.py) against ggml's own (ggml_quantize_chunk, what
    llama-quantize calls) on a realistic-scale matrix of that width with hard rows added (zeros, constants, values
    below ggml's 1e-15 group threshold, values on a grid that puts rounding on its ties, one sign only, an outlier,
    Q8_0's half-steps):
    the bytes equal?
  files: a realistic-scale GPT-2 of that width (n_layer --layers, the real vocabulary) exported as f32, quantized by
    llama-cpp-python's llama_model_quantize, and exported by gpt2port at that type: every tensor of the same GGML
    type with the same bytes?
Prints one line per check. Needs llama-cpp-python (not a gpt2port dependency: it builds llama.cpp from source).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

from gpt2port import export
from gpt2port.formats import gguf_quants
from gpt2port.registry import GGUF_QUANTS
from gpt2port.targets.gguf import FILE_NAME
from gpt2port.targets.gguf_recipe import RECIPES

Q = gguf.GGMLQuantizationType


@functools.cache
def _ggml() -> ctypes.CDLL:
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    lib = ctypes.CDLL(str(min(lib_dir.glob("libggml-base.so*"))))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


def ggml_quantize(values: np.ndarray, qtype: Q) -> np.ndarray:
    """ggml's own quantization of float32 rows `values` (no importance matrix, as llama-quantize runs)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    rows, width = values.shape
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    out = np.zeros((rows, width // block * size), dtype=np.uint8)
    _ggml().ggml_quantize_chunk(int(qtype), values.ctypes.data, out.ctypes.data, 0, rows, width, None)
    return out


def hard_matrix(rows: int, width: int, seed: int = 0) -> np.ndarray:
    """A realistic-scale weight matrix (std 2.5/sqrt(width) with two outlier columns, as tests/realistic.py makes
    GPT-2's) whose first rows are the cases where the quantizers' arithmetic decides the bytes."""
    rng = np.random.default_rng(seed)
    std = 2.5 / np.sqrt(width)
    x = (rng.standard_normal((rows, width)) * std).astype(np.float32)
    x[:, rng.permutation(width)[:2]] += np.float32(8 * std)
    hard = [
        np.zeros(width),  # every group empty
        np.full(width, 0.03),  # constant: max == min
        rng.standard_normal(width) * 1e-17,  # below ggml's GROUP_MAX_EPS
        np.round(rng.standard_normal(width) * 16) / 32 * std,  # on a grid: rounding meets its ties
        np.abs(rng.standard_normal(width)) * std + std,  # positive only: the min clamped to 0
        -np.abs(rng.standard_normal(width)) * std,  # negative only
        np.where(np.arange(width) % 97 == 0, 40 * std, rng.standard_normal(width) * std),  # an outlier per group
        np.tile(np.repeat([1.0, -1.0], 16), width // 32) * std,  # two values per group
        # exact half-steps of Q8_0's scale (a group's max / 127): roundf's ties, away from zero, not to even
        np.tile(np.r_[127.0, np.arange(31) % 16 * 8 + 0.5], width // 32) * std / 64,
    ]
    for i, row in enumerate(hard[:rows]):
        x[i] = row
    return x


def check_blocks(width: int, rows: int, types=gguf_quants.TYPES) -> dict[str, tuple[int, int]]:
    """Type name -> (rows equal, rows compared) of gpt2port's quantizer against ggml's on hard_matrix."""
    x = hard_matrix(rows, width, seed=width)
    out = {}
    for qtype in types:
        if width % gguf.GGML_QUANT_SIZES[qtype][0]:
            continue
        ours, theirs = gguf_quants.quantize(x, qtype), ggml_quantize(x, qtype)
        out[qtype.name] = (int((ours == theirs).all(axis=1).sum()), rows)
    return out


def llama_quantize(src: Path, dst: Path, recipe: str, threads: int = 2) -> None:
    """llama-cpp-python's llama_model_quantize of the GGUF `src` at file type `recipe`, its log (a line per tensor,
    on the C stderr) silenced."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(RECIPES[recipe][0])
    params.nthread = threads
    with _quiet_stderr():
        failed = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if failed:
        raise RuntimeError(f"llama_model_quantize failed on {src}")


@contextlib.contextmanager
def _quiet_stderr():
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def tensors(path: Path) -> dict[str, tuple[str, bytes]]:
    """Every tensor of a GGUF: name -> (GGML type name, stored bytes)."""
    return {t.name: (Q(t.tensor_type).name, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(path).tensors}


def compare(ours: Path, theirs: Path) -> list[str]:
    """What differs between two GGUFs' tensors (names, types, bytes), one line each; [] when none does."""
    a, b = tensors(ours), tensors(theirs)
    problems = [f"{n}: only in {'ours' if n in a else 'llama.cpp'}" for n in sorted(set(a) ^ set(b))]
    for name in sorted(set(a) & set(b)):
        if a[name][0] != b[name][0]:
            problems.append(f"{name}: {a[name][0]} here, {b[name][0]} in llama.cpp")
        elif a[name][1] != b[name][1]:
            problems.append(f"{name}: {a[name][0]} bytes differ")
    return problems


def check_files(ckpt: Path, recipes, work: Path):
    """Yields (recipe, {problems, types (GGML type -> count), ours_s, llama_s}) for the checkpoint `ckpt`."""
    export(ckpt, work / "f32", to="gguf", dtype="fp32", force=True)
    for recipe in recipes:
        t0 = time.perf_counter()
        export(ckpt, work / recipe, to="gguf", dtype=recipe, force=True)
        t1 = time.perf_counter()
        theirs = work / f"llama-{recipe}.gguf"
        llama_quantize(work / "f32" / FILE_NAME, theirs, recipe)
        t2 = time.perf_counter()
        ours = work / recipe / FILE_NAME
        types: dict[str, int] = {}
        for kind, _ in tensors(ours).values():
            types[kind] = types.get(kind, 0) + 1
        yield recipe, {"problems": compare(ours, theirs), "types": types, "ours_s": t1 - t0, "llama_s": t2 - t1}
        theirs.unlink()
        shutil.rmtree(work / recipe)


def realistic_gpt2(out: Path, width: int, layers: int) -> Path:
    """A gpt2port checkpoint of realistic-scale weights, `width` wide (64-wide heads), `layers` deep."""
    from tests.realistic import realistic_checkpoint

    shape = dict(n_layer=layers, n_head=width // 64, n_embd=width, n_positions=64, vocab_size=50257)
    return realistic_checkpoint(out, shape, seed=width)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", default="768,1600")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--types", default=",".join(t for t in GGUF_QUANTS if t != "q8_0") + ",q8_0")
    ap.add_argument("--no-files", action="store_true", help="the blocks check only")
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    for width in widths:
        for extra in (1, 4):  # the matrices' input widths in a GPT-2: C (qkv, attn_output, ffn_up), 4C (ffn_down)
            for name, (equal, rows) in check_blocks(width * extra, args.rows).items():
                print(f"blocks {name:5s} width {width * extra:5d}: {equal}/{rows} rows byte-equal to ggml", flush=True)
    if args.no_files:
        return
    for width in widths:
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = realistic_gpt2(Path(tmp) / "model", width, args.layers)
            for recipe, r in check_files(ckpt, args.types.split(","), Path(tmp)):
                kinds = " ".join(f"{k}x{n}" for k, n in sorted(r["types"].items()))
                verdict = "byte-equal" if not r["problems"] else f"{len(r['problems'])} differ: {r['problems'][:3]}"
                print(f"file {recipe:6s} width {width} layers {args.layers}: {verdict} ({kinds}; "
                      f"gpt2port {r['ours_s']:.1f} s, llama.cpp {r['llama_s']:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
