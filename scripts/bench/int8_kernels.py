"""int8 decoding on each PyTorch kernel gpt2port can use for its one-row products: fbgemm's dynamic int8
linear (torch.ops.quantized.linear_dynamic, activations quantized per token: what `--dtype int8` decodes with) and
torch._weight_int8pack_mm (bf16 activations: its fallback where fbgemm is missing).
One process, the two models alternating round by round, greedy from a 16-token prompt, 64 new tokens each (the
prefill included), wall and CPU time per token.

--torchao adds torchao's weight-only int8 (quantize_ with Int8WeightOnlyConfig, run as it is, no torch.compile) on
the fp32 model, every linear layer but the head (tied to the embedding, which torchao's tensor cannot serve), on
PyTorch's kernels alone (gpt2port.fast.OFF: its layers cannot take torchao's weights). torchao is no dependency of
gpt2port: put it on PYTHONPATH (`pip install --target DIR --no-deps torchao`).

Usage (from the repository root; any gpt2port checkpoint directory):
    python -m scripts.bench.int8_kernels --ckpt DIR [--threads 1] [--rounds 3] [--torchao]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from gpt2port import GPT
from gpt2port.fast import OFF, Settings
from gpt2port.generate import generate
from gpt2port.quant import quantized_model

NEW_TOKENS = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--torchao", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = {"fbgemm": quantized_model(GPT, args.ckpt), "int8pack": quantized_model(GPT, args.ckpt, fbgemm=False)}
    fast = dict.fromkeys(models, Settings())
    if args.torchao:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        model = GPT.from_pretrained(args.ckpt)
        quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, name: isinstance(m, torch.nn.Linear) and
                  name != "lm_head")
        models["torchao int8 weight-only (head fp32)"], fast["torchao int8 weight-only (head fp32)"] = model, OFF
    prompt = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(0)).tolist()
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    for name, model in models.items():  # warm-up
        generate(model, prompt, 4, temperature=0, stop_token=None, fast=fast[name])
    for _ in range(args.rounds):
        for name, model in models.items():
            t, cpu = time.perf_counter(), time.process_time()
            generate(model, prompt, NEW_TOKENS, temperature=0, stop_token=None, fast=fast[name])
            wall, cpu = time.perf_counter() - t, time.process_time() - cpu
            got[name].append((1e3 * wall / NEW_TOKENS, 1e3 * cpu / NEW_TOKENS))
    for name, runs in got.items():
        wall, cpu = zip(*runs)
        print(f"{name}: {statistics.median(wall):.2f} ms/token ({min(wall):.2f}-{max(wall):.2f}), CPU "
              f"{statistics.median(cpu):.2f} ms/token ({min(cpu):.2f}-{max(cpu):.2f}); load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
