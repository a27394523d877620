"""gpt2port: Hugging Face GPT-2 checkpoints in a clean from-scratch PyTorch model, with proof of parity."""

__version__ = "0.1.0"

from gpt2port.config import GPTConfig  # noqa: E402
from gpt2port.errors import GPT2PortError  # noqa: E402
from gpt2port.model import GPT, KVCache  # noqa: E402


def load_tokenizer(ckpt):
    """The checkpoint's GPT-2 BPE as a tiktoken.Encoding, built from its own files (no network)."""
    from gpt2port.tokenizer import load_tokenizer as _load

    return _load(ckpt)


__all__ = ["GPT", "GPTConfig", "GPT2PortError", "KVCache", "load_tokenizer", "__version__"]
