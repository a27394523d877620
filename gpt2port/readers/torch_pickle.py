"""A PyTorch pickle read as a GPT-2: a training checkpoint's "model_args" (nanoGPT's ckpt.pt) made the model's sizes
(the pickle itself is formats/torch_pickle.py's)."""

from __future__ import annotations

from pathlib import Path

from gpt2port.errors import GPT2PortError
from gpt2port.formats.torch_pickle import PickleReader

# config.json's names -> where a training checkpoint keeps them
NANOGPT_KEYS = {"n_layer": "model_args.n_layer", "n_head": "model_args.n_head", "n_embd": "model_args.n_embd",
                "vocab_size": "model_args.vocab_size", "n_positions": "model_args.block_size"}


class ModelPickleReader(PickleReader):
    def __init__(self, path: Path):
        super().__init__(path)
        self.model_config = _sizes(self.model_args, self.path)
        self.config_keys = NANOGPT_KEYS if self.model_config is not None else {}


def _sizes(args: dict | None, file: Path) -> dict | None:
    """config.json-style sizes from a training checkpoint's "model_args" (block_size is the context length), or None
    where it has none or not all of them."""
    if args is None:
        return None
    if args.get("bias") is False:
        raise GPT2PortError(f"{file}: model_args say bias=False; GPT-2 has a bias in every linear layer and "
                            f"LayerNorm, so this model cannot be held as GPT-2 (train with bias=True)")
    sizes = {"n_layer": args.get("n_layer"), "n_head": args.get("n_head"), "n_embd": args.get("n_embd"),
             "vocab_size": args.get("vocab_size"), "n_positions": args.get("block_size", args.get("n_positions"))}
    sizes = {k: v for k, v in sizes.items() if v is not None}
    complete = {"n_layer", "n_head", "n_embd", "vocab_size"} <= set(sizes)
    return sizes if complete else None
