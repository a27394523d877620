"""Generation speed of gpt2port vs Hugging Face transformers, side by side in one process, same threads, same device.

For each size: a random-weight hub-layout checkpoint is written (hf_fixtures.write_random_hub_file), converted with
gpt2port, and loaded by both gpt2port and transformers' GPT2LMHeadModel from the same files. Then:

  decode   greedy, a 16-token prompt (--prompt-tokens: another length, up to 896: decoding deep into the context,
           where each step also reads the keys and values of every position before it), 128 new tokens (no
           early stop), tokens/s including the prompt's prefill.
           Contenders: gpt2port fp32 (the default: one-row products and one-token attention on gpt2port's own
           kernels, gpt2port/fast/native.py, other products on oneDNN), gpt2port fp32 with one row on oneDNN too
           and attention on SDPA (Settings(native=False), as before those kernels), gpt2port fp32 with only
           attention on SDPA (Settings(attend_one=False)), gpt2port fp32 with neither kernel nor oneDNN
           (F.linear, i.e. MKL, as HF uses), and HF generate fp32; they alternate
           run by run, so all see the same machine load, and the best run
           of each counts. Then gpt2port bf16 (one row on gpt2port's kernel) and the same on F.linear, alternating.
           Then (CPU) gpt2port int8 (GPT.from_pretrained(..., dtype="int8")) and, when llama-cpp-python is
           installed, llama.cpp on the same weights exported to GGUF q8_0, greedy through its own sampler
           (scripts/bench/llama_contender.py), interleaved likewise; these quantized rounds run
           in a fresh interpreter, as `gpt2port generate --dtype int8` loads its model.
  floor    each decode rate as a fraction of the memory-bandwidth floor: a decode step must stream every weight
           once, so tokens/s <= bandwidth / bytes of weights per token, with the bandwidth measured here by a large
           fp32 matrix-vector product (gpt2port.fast.speed: one row against a 256 MB weight; the fastest of F.linear,
           oneDNN and gpt2port's kernel), probed at the start and again right before every run, its best counting
           as each rate's best does (one probe caught in a burst of load elsewhere once put fp32 at "97% of the
           floor"). int8 and q8_0 stream their own encodings: about a quarter of the fp32 bytes. Also each run
           against the probe taken right before it, the median over the rounds: this machine's bandwidth swings
           from minute to minute, and the best rate over the best probe sets two different minutes against each
           other (so did a probe once a round, at 1.5B up to two minutes before the run it was paired with).
           The floor counts the weights only: after a long prompt a step also reads the cache's keys and values
           (124M fp32 after 900 positions: 66 MB against 495 MB of weights), so there it understates what a
           step could reach.
  step     for gpt2port fp32 and int8: a step's time (1 / tokens/s, the prefill spread over the tokens) beside
           that of its matrix products alone, back to back: the difference is attention, norms, Python, dispatch.
           The products alone are also given as a fraction of a probe taken right after them: the most a step
           could reach on its kernel, had it nothing else to do.
  prefill  one forward over 1024 tokens with all logits, each fp32 contender, in the same rounds.

--device cuda runs the same on a GPU (no MKL contender there; "gpt2port fp32" is the step recorded as a CUDA graph,
Settings(cuda_graph=True), "eager" the same forward not recorded; timings synchronize the device). The targets in the
README are for the CPU run; scripts/bench/generate_cuda.py sets the recorded step against HF's static cache +
compile on a GPU.

Usage (from the repository root):
    python -m scripts.bench.generate [--sizes gpt2,gpt2-xl] [--threads 2] [--repeats 3] [--json out.json]
                                     [--device cuda] [--prompt-tokens 16]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpt2port import GPT, convert
from gpt2port.fast import OFF, Settings
from gpt2port.fast.kernels import accelerated
from gpt2port.fast.speed import matvec_bandwidth, timed, weight_bytes_per_token
from gpt2port.generate import steps
from scripts import ROOT, hf_fixtures
from scripts.bench import llama_contender

PROMPT_LEN, NEW_TOKENS, PREFILL_LEN = 16, 128, 1024
OURS, MKL, HF, OURS_BF16 = "gpt2port fp32", "gpt2port fp32, F.linear/MKL", "HF fp32", "gpt2port bf16"
BF16_LINEAR = "gpt2port bf16, F.linear"  # one row of bf16 as before gpt2port's kernel took it
OURS_INT8, LLAMA_Q8 = "gpt2port int8", "llama.cpp q8_0"
EAGER = "gpt2port fp32, eager (no CUDA graph)"
ONEDNN_ROW = "gpt2port fp32, one row on oneDNN"
SDPA_ATTENTION = "gpt2port fp32, attention on SDPA"
# Each contender's gpt2port.fast settings
FAST, GRAPHED = Settings(), Settings(cuda_graph=True)
ONEDNN_ROW_SETTINGS, SDPA_SETTINGS = Settings(native=False), Settings(attend_one=False)
MKL_SETTINGS = Settings(native=False, onednn=False)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def ours_decode(model: GPT, prompt: torch.Tensor, fast: Settings = FAST) -> tuple[float, list[int]]:
    tokens = []
    _sync()
    t = time.perf_counter()
    for step in steps(model, prompt, max_new_tokens=NEW_TOKENS, temperature=0, stop_token=None, fast=fast):
        tokens.append(int(step[0]))
    return NEW_TOKENS / (time.perf_counter() - t), tokens


def hf_decode(model, prompt: torch.Tensor) -> tuple[float, list[int]]:
    with torch.inference_mode():
        _sync()
        t = time.perf_counter()
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
        _sync()
        seconds = time.perf_counter() - t
    return NEW_TOKENS / seconds, out[0, prompt.size(1):].tolist()


def accelerated_forward(model: GPT, settings: Settings):
    """The model's forward with gpt2port.fast's layers swapped in per `settings`, as generate's prefill runs it."""
    def forward(idx: torch.Tensor) -> torch.Tensor:
        with accelerated(model, settings):
            return model(idx)[0]
    return forward


def prefill_seconds(forward, idx: torch.Tensor) -> float:
    with torch.inference_mode():
        return timed(lambda: forward(idx), idx.device)


def prepare(size: str, root: Path) -> tuple[Path, Path]:
    hf_dir, ckpt = root / f"{size}-hf", root / f"{size}-gpt2port"
    if not (hf_dir / "model.safetensors").is_file():
        hf_dir.mkdir(parents=True, exist_ok=True)
        print(f"[{size}] writing random hub-layout weights to {hf_dir}", file=sys.stderr)
        hf_fixtures.write_random_hub_file(hf_dir / "model.safetensors", size, "fp32", seed=0)
        for name, path in hf_fixtures.tokenizer_files().items():  # so `gpt2port generate` runs on the result
            shutil.copyfile(path, hf_dir / name)
    if not (ckpt / "model.safetensors").is_file():
        print(f"[{size}] converting to {ckpt}", file=sys.stderr)
        convert(hf_dir, ckpt, force=True)
    return hf_dir, ckpt


def bench_size(size: str, root: Path, repeats: int, bandwidths: list[float], device: str,
               prompt_len: int = PROMPT_LEN) -> dict:
    """Decode and prefill rates of each contender; the fp32 ones run interleaved, repeat by repeat. The bandwidth
    probe runs in every round too (appended to `bandwidths`): the floor is its best, as each rate is its best run."""
    from transformers import GPT2LMHeadModel

    hf_dir, ckpt = prepare(size, root)
    ours = GPT.from_pretrained(ckpt, device=device)
    hf = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    hf.generation_config.eos_token_id = None  # all 128 tokens, and no stop check: as ours with stop_token=None
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 50257, (1, prompt_len), generator=g).to(device)
    long = torch.randint(0, 50257, (1, PREFILL_LEN), generator=g).to(device)
    default = FAST if device == "cpu" else GRAPHED
    fp32 = {OURS: (lambda p: ours_decode(ours, p, default), accelerated_forward(ours, FAST)),
            MKL: (lambda p: ours_decode(ours, p, MKL_SETTINGS), accelerated_forward(ours, MKL_SETTINGS)),
            # prefill: many rows, as OURS
            ONEDNN_ROW: (lambda p: ours_decode(ours, p, ONEDNN_ROW_SETTINGS), None),
            SDPA_ATTENTION: (lambda p: ours_decode(ours, p, SDPA_SETTINGS), None),  # prefill: SDPA, as OURS
            HF: (lambda p: hf_decode(hf, p), lambda i: hf(i).logits),
            EAGER: (lambda p: ours_decode(ours, p, FAST), None)}  # decode only: its prefill is OURS's
    if device != "cpu":  # oneDNN vs MKL vs gpt2port's kernel is a CPU question
        del fp32[MKL], fp32[ONEDNN_ROW], fp32[SDPA_ATTENTION]
    else:  # on the CPU the default is the eager forward already
        del fp32[EAGER]

    print(f"[{size}] warm-up", file=sys.stderr)
    with torch.inference_mode():
        for decode, forward in fp32.values():
            decode(prompt[:, :4])
            if forward is not None:
                forward(long[:, :64])
    # Round-robin, decode then prefill, so a burst of load elsewhere on the machine hits every contender alike;
    # the best run of each is its speed on a quiet machine.
    rates, prefill, tokens = {name: [] for name in fp32}, {name: [] for name in fp32}, {}
    probes: dict[str, list[float]] = {name: [] for name in fp32}  # the probe right before each run, for pairing
    for r in range(repeats):
        for name, (decode, forward) in fp32.items():
            bandwidths.append(matvec_bandwidth(device, repeats=5))
            probes[name].append(bandwidths[-1])  # right before the run it is paired with
            rate, tokens[name] = decode(prompt)
            rates[name].append(rate)
            if forward is not None:
                prefill[name].append(prefill_seconds(forward, long))
        print(f"[{size}] run {r + 1}/{repeats}: " + ", ".join(
            f"{k} {v[-1]:.2f} tokens/s" + (f", prefill {prefill[k][-1]:.2f} s" if prefill[k] else "")
            for k, v in rates.items()), file=sys.stderr)
    prefill = {name: min(v) for name, v in prefill.items() if v}
    bytes_per_token = {name: weight_bytes_per_token(ours) for name in fp32}
    products_ms, products_probe = {OURS: products_alone_ms(ours)}, {OURS: matvec_bandwidth(device, repeats=5)}
    hf = ours = None  # free both models (the contenders above are done with them)
    gc.collect()

    bf16 = GPT.from_pretrained(ckpt, dtype=torch.bfloat16, device=device)
    ours_decode(bf16, prompt[:, :4])
    bf16_contenders = {OURS_BF16: lambda m, p: ours_decode(m, p, default),
                       BF16_LINEAR: lambda m, p: ours_decode(m, p, OFF)}
    if device != "cpu":  # gpt2port's kernel is a CPU one: on a GPU the two would be the same
        del bf16_contenders[BF16_LINEAR]
    for name in bf16_contenders:
        rates[name], probes[name], bytes_per_token[name] = [], [], weight_bytes_per_token(bf16)
    for _ in range(repeats):
        for name, decode in bf16_contenders.items():
            bandwidths.append(matvec_bandwidth(device, repeats=5))
            probes[name].append(bandwidths[-1])
            rates[name].append(decode(bf16, prompt)[0])
    del bf16
    gc.collect()
    if device == "cpu":
        quantized_rounds_fresh(size, ckpt, root, prompt, repeats, rates, tokens, bytes_per_token, products_ms,
                               bandwidths, probes, products_probe)

    best = {k: max(v) for k, v in rates.items()}
    bandwidth = max(bandwidths)
    return {
        "size": size,
        "prompt_tokens": prompt_len,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "tokens_per_s": best,
        "all_runs": rates,
        "bandwidth_bytes_per_s": bandwidth,
        "vs_hf": {k: best[k] / best[HF] for k in best},
        "floor_tokens_per_s": {k: bandwidth / b for k, b in bytes_per_token.items()},
        "fraction_of_floor": {k: best[k] / (bandwidth / bytes_per_token[k]) for k in best},
        # Each run against the probe right before it, the median over rounds: the best rate over the best probe
        # pairs two different moments of a machine whose bandwidth swings by 1.5x from minute to minute.
        "paired_fraction_of_floor": {k: statistics.median(r * bytes_per_token[k] / b for r, b in zip(v, probes[k]))
                                     for k, v in rates.items()},
        # The matrix products alone against a probe taken right after them: the most the step could reach with
        # nothing but its products, on the kernel it has.
        "products_alone_fraction_of_floor": {k: bytes_per_token[k] / (ms / 1e3) / products_probe[k]
                                             for k, ms in products_ms.items()},
        "greedy_tokens_equal_to_hf": f"{sum(a == b for a, b in zip(tokens[OURS], tokens[HF]))}/{NEW_TOKENS}",
        # int8 and q8_0 round every weight, so their greedy paths may part from fp32's; how soon is worth seeing
        "greedy_prefix_equal_to_fp32": {k: _common_prefix(tokens[k], tokens[OURS]) for k in (OURS_INT8, LLAMA_Q8)
                                        if k in tokens},
        "products_alone_ms": products_ms,
        "prefill_seconds": prefill,
        "prefill_vs_hf": {k: prefill[HF] / v for k, v in prefill.items()},
    }


def quantized_rounds(size: str, ckpt: Path, root: Path, prompt: torch.Tensor, repeats: int, rates: dict,
                     tokens: dict, bytes_per_token: dict, products_ms: dict, bandwidths: list[float], probes: dict,
                     products_probe: dict) -> None:
    """gpt2port int8 and, when llama-cpp-python is installed, llama.cpp on the same weights exported as q8_0 GGUF,
    interleaved round by round like the fp32 contenders."""
    int8 = GPT.from_pretrained(ckpt, dtype="int8")
    products_ms[OURS_INT8] = products_alone_ms(int8)
    products_probe[OURS_INT8] = matvec_bandwidth("cpu", repeats=5)
    contenders = {OURS_INT8: lambda p: ours_decode(int8, p)}
    bytes_per_token[OURS_INT8] = weight_bytes_per_token(int8)
    llama = llama_contender.q8_0_model(ckpt, root / f"{size}-q8_0", prompt.size(1) + NEW_TOKENS + 8)
    if llama is not None:
        llm, bytes_per_token[LLAMA_Q8] = llama
        contenders[LLAMA_Q8] = lambda p: llama_contender.decode(llm, p, NEW_TOKENS)
    else:
        print(f"[{size}] llama-cpp-python is not installed: no llama.cpp q8_0 contender", file=sys.stderr)
    for decode in contenders.values():
        decode(prompt[:, :4])
    for name in contenders:
        rates[name], probes[name] = [], []
    for r in range(repeats):
        for name, decode in contenders.items():
            bandwidths.append(matvec_bandwidth("cpu", repeats=5))
            probes[name].append(bandwidths[-1])
            rate, tokens[name] = decode(prompt)
            rates[name].append(rate)
        print(f"[{size}] quantized run {r + 1}/{repeats}: " + ", ".join(
            f"{k} {rates[k][-1]:.2f} tokens/s" for k in contenders), file=sys.stderr)


def quantized_rounds_fresh(size: str, ckpt: Path, root: Path, prompt: torch.Tensor, repeats: int, rates: dict,
                           tokens: dict, bytes_per_token: dict, products_ms: dict, bandwidths: list[float],
                           probes: dict, products_probe: dict) -> None:
    """quantized_rounds in a fresh interpreter, as `gpt2port generate --dtype int8` loads its model: where the int8
    weights land depends on what the heap already holds, and here it would hold the holes the fp32 and bf16 rounds
    left."""
    ids = ",".join(str(t) for t in prompt[0].tolist())
    child = subprocess.run([sys.executable, "-m", "scripts.bench.generate", "--threads", str(torch.get_num_threads()),
                            "--quantized-child", size, str(ckpt), str(root), str(repeats), ids],
                           stdout=subprocess.PIPE, text=True, check=True, cwd=ROOT)
    got = json.loads(child.stdout.strip().splitlines()[-1])
    rates.update(got["rates"])
    tokens.update(got["tokens"])
    bytes_per_token.update(got["bytes_per_token"])
    products_ms.update(got["products_ms"])
    bandwidths.extend(got["bandwidths"])
    probes.update(got["probes"])
    products_probe.update(got["products_probe"])


def _quantized_child(size: str, ckpt: str, root: str, repeats: str, ids: str) -> None:
    prompt = torch.tensor([[int(t) for t in ids.split(",")]])
    got: dict = {"rates": {}, "tokens": {}, "bytes_per_token": {}, "products_ms": {}, "bandwidths": [], "probes": {},
                 "products_probe": {}}
    quantized_rounds(size, Path(ckpt), Path(root), prompt, int(repeats), got["rates"], got["tokens"],
                     got["bytes_per_token"], got["products_ms"], got["bandwidths"], got["probes"],
                     got["products_probe"])
    print(json.dumps(got))


def products_alone_ms(model) -> float:
    """Milliseconds the model's matrix products take for one token when run back to back, nothing else (best of 5):
    what a decode step costs beyond this is attention, norms, Python and dispatch."""
    from gpt2port.quant import Int8Linear

    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, Int8Linear))]
    rows = [torch.randn(1, 1, m.in_features) for m in layers]
    with torch.inference_mode(), accelerated(model, FAST):
        for m, x in zip(layers, rows):
            m(x)
        return 1e3 * min(timed(lambda: [m(x) for m, x in zip(layers, rows)]) for _ in range(5))


def _common_prefix(a: list[int], b: list[int]) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{n}/{NEW_TOKENS}"


def report(result: dict) -> str:
    lines = [f"== {result['size']} on {result['device']} ==  decode: greedy, {result['prompt_tokens']}-token prompt, "
             f"{NEW_TOKENS} new tokens (best of the runs)"]
    for k, rate in result["tokens_per_s"].items():
        lines.append(f"  {k:28s} {rate:7.2f} tokens/s  {result['vs_hf'][k]:5.2f}x HF   "
                     f"{result['fraction_of_floor'][k]:6.1%} of its bandwidth floor "
                     f"({result['floor_tokens_per_s'][k]:.1f} tokens/s; run by run against the probe before it, "
                     f"median {result['paired_fraction_of_floor'][k]:.1%})")
    for k, ms in result["products_alone_ms"].items():
        lines.append(f"  {k}: a token takes {1e3 / result['tokens_per_s'][k]:.2f} ms (its share of the prefill "
                     f"included), its matrix products alone "
                     f"{ms:.2f} ms ({result['products_alone_fraction_of_floor'][k]:.1%} of the floor probed right "
                     f"after them)")
    lines.append(f"  greedy tokens equal to HF's: {result['greedy_tokens_equal_to_hf']}")
    for k, n in result["greedy_prefix_equal_to_fp32"].items():
        lines.append(f"  {k}: greedy tokens equal to gpt2port fp32's for the first {n}")
    lines.append(f"  prefill, one {PREFILL_LEN}-token forward with all logits (best of the runs):")
    for k, seconds in result["prefill_seconds"].items():
        lines.append(f"  {k:28s} {seconds:7.3f} s        {result['prefill_vs_hf'][k]:5.2f}x HF")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="gpt2", help="comma-separated: gpt2, gpt2-medium, gpt2-large, gpt2-xl")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--repeats", type=int, default=5, help="rounds of runs; the best of each contender counts")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the random checkpoints here for reuse")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--device", default="cpu", help="cpu (the targets' setting) or cuda")
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_LEN,
                    help=f"the decode prompt's length (at most {1024 - NEW_TOKENS}: the context holds it and the "
                         f"{NEW_TOKENS} new tokens)")
    ap.add_argument("--quantized-child", nargs=5, help=argparse.SUPPRESS)  # SIZE CKPT ROOT REPEATS IDS (internal)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(args.threads)
    if args.quantized_child:
        return _quantized_child(*args.quantized_child)
    if not 1 <= args.prompt_tokens <= 1024 - NEW_TOKENS:
        ap.error(f"--prompt-tokens must be between 1 and {1024 - NEW_TOKENS}")

    bandwidths = [matvec_bandwidth(args.device)]
    print(f"torch {torch.__version__}, {args.device}, {args.threads} CPU threads, "
          f"fp32 matvec bandwidth {bandwidths[0] / 1e9:.1f} GB/s (probed again each round; the best counts)")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
        root = args.workdir or Path(tmp)
        for size in args.sizes.split(","):
            results.append(bench_size(size.strip(), root, args.repeats, bandwidths, args.device, args.prompt_tokens))
            print(report(results[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "bandwidth_bytes_per_s": max(bandwidths),
                                         "torch": torch.__version__, "results": results}, indent=2))


if __name__ == "__main__":
    main()
