"""Benchmark: GPT-2 into a user's own class with gpt2port.load_into, side by side with gpt2port's own loader and
with the loader a learner writes by hand.

Builds a random-weight checkpoint at --size (default gpt2-xl) in the hub layout, converts it once, then measures in
fresh processes, one after the other in the same run, each up to the first logits of a 4-token prompt:
  (a) load_into: the class below built under gpt2port.init_empty() (parameters on meta), filled from the
      gpt2port checkpoint
  (a') load_into the same class from the Hugging Face directory (transposes: every tensor copied, streamed)
  (b) GPT.from_pretrained(checkpoint): gpt2port's own class, memory-mapped
  (c) by hand, as tutorials do: the class built normally (random init), transformers' GPT2LMHeadModel loaded,
      each tensor copied over with its transpose (skipped with --skip-baseline; needs two models of memory)
Targets: (a) peak RSS <= 1.15x the class's weights.

    python -m scripts.bench.load_into [--size gpt2-xl] [--workdir /tmp/gpt2port-bench] [--repeat N]
                                      [--skip-baseline] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from scripts import ROOT
from scripts.bench.convert import _vm_hwm_kib, warm
PROMPT = [[464, 3290, 373, 1043]]


# --- a user's class, in the style most people copy (nanoGPT's layout; GPT-2's tanh GELU) --------------------------

class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_head = c.n_head
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(c.n_embd), Attention(c), nn.LayerNorm(c.n_embd)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * c.n_embd, c.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MyGPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(c.vocab_size, c.n_embd), nn.Embedding(c.n_positions, c.n_embd)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# --- steps, each in its own process ------------------------------------------------------------------------------

def step_load_into(ckpt: Path, hf: Path) -> dict:
    import gpt2port
    from gpt2port.checkpoint import read_config

    with gpt2port.init_empty():
        model = MyGPT(read_config(ckpt))
    gpt2port.load_into(model, ckpt)
    return _first_logits(model)


def step_load_into_hf(ckpt: Path, hf: Path) -> dict:
    """The same, from the Hugging Face directory: every tensor transposed or copied, streamed one at a time."""
    import gpt2port
    from gpt2port.checkpoint import read_config

    with gpt2port.init_empty():
        model = MyGPT(read_config(ckpt))
    gpt2port.load_into(model, hf)
    return _first_logits(model)


def step_from_pretrained(ckpt: Path, hf: Path) -> dict:
    from gpt2port import GPT

    return _first_logits(GPT.from_pretrained(ckpt))


def step_by_hand(ckpt: Path, hf: Path) -> dict:
    """What a tutorial's loader does: its class allocated and initialised, HF's model beside it, copy each tensor."""
    from transformers import GPT2LMHeadModel

    from gpt2port.checkpoint import read_config

    model = MyGPT(read_config(ckpt))
    sd_hf = GPT2LMHeadModel.from_pretrained(hf).state_dict()
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    mlp = {"mlp.c_fc": "mlp.0", "mlp.c_proj": "mlp.2"}
    with torch.no_grad():
        for k, v in sd_hf.items():
            name = k.removeprefix("transformer.")
            if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):  # mask buffers
                continue
            for a, b in mlp.items():
                name = name.replace(a, b)
            dict(model.named_parameters())[name].copy_(v.t() if k.endswith(conv1d) else v)
    del sd_hf
    return _first_logits(model)


def _first_logits(model) -> dict:
    with torch.inference_mode():
        out = model(torch.tensor(PROMPT))
    logits = out[0] if isinstance(out, tuple) else out  # gpt2port's GPT: (logits, loss); a user's class: its own
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"weights_gb": n / 1e9, "checksum": float(logits[0, -1, :5].double().sum())}


STEPS = {"load_into": step_load_into, "load_into_hf": step_load_into_hf, "from_pretrained": step_from_pretrained,
         "by_hand": step_by_hand}


def run_step(name: str, ckpt: Path, hf: Path) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.load_into", "--step", name, str(ckpt), str(hf)],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    if proc.returncode != 0:
        raise SystemExit(f"step {name} failed:\n{proc.stderr[-3000:]}")
    return {"step": name, "wall_s": time.perf_counter() - t0, **json.loads(proc.stdout.strip().splitlines()[-1])}


def _child(name: str, ckpt: str, hf: str) -> None:
    facts = STEPS[name](Path(ckpt), Path(hf))
    print(json.dumps({**facts, "peak_rss_gb": _vm_hwm_kib() * 1024 / 1e9}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="gpt2-xl")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gpt2port-bench"))
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--repeat", type=int, default=1, help="run the loaders in turn this many times; report each one's "
                                                          "best (this machine's page cache is reclaimed eagerly)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--step", nargs=3, metavar=("NAME", "CKPT", "HF"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.step:
        return _child(*args.step)
    work = args.workdir / args.size
    hf, ckpt = work / "hf", work / "ckpt"
    if not (hf / "model.safetensors").exists():
        print(f"building a random {args.size} checkpoint at {hf} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "scripts.hf_fixtures", str(hf), "--size", args.size, "--streamed"],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    if not (ckpt / "model.safetensors").exists():
        subprocess.run([sys.executable, "-m", "gpt2port", "convert", str(hf), "--out", str(ckpt), "-q"], cwd=ROOT,
                       check=True)
    steps = ["load_into", "load_into_hf", "from_pretrained"] + ([] if args.skip_baseline else ["by_hand"])
    results = {}
    for _ in range(args.repeat):
        for name in steps:
            warm(ckpt / "model.safetensors")
            if name in ("by_hand", "load_into_hf"):
                warm(hf / "model.safetensors")
            r = run_step(name, ckpt, hf)
            if name not in results or r["wall_s"] < results[name]["wall_s"]:
                results[name] = r
    sums = {r["checksum"] for r in results.values()}
    print(f"\n## load {args.size} into a user's class to first logits (fresh process, imports included; "
          f"page cache warm; {os.cpu_count()} cores)\n")
    print("| loader | wall (s) | peak RSS (GB) | RSS / the class's weights |")
    print("|---|---:|---:|---:|")
    for name in steps:
        r = results[name]
        print(f"| {name} | {r['wall_s']:.1f} | {r['peak_rss_gb']:.2f} | {r['peak_rss_gb'] / r['weights_gb']:.2f} |")
    a = results["load_into"]
    print(f"\nload_into = {a['wall_s'] / results['from_pretrained']['wall_s']:.2f}x GPT.from_pretrained's time"
          + (f", {results['by_hand']['wall_s'] / a['wall_s']:.1f}x faster than by hand"
             if "by_hand" in results else ""))
    print(f"target: peak RSS {a['peak_rss_gb'] / a['weights_gb']:.2f}x weights (<= 1.15); "
          f"first logits agree across loaders: {len(sums) == 1 or max(sums) - min(sums) < 1e-3 * max(map(abs, sums))}")
    print(json.dumps(results), file=sys.stderr)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

