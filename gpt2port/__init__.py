"""gpt2port: GPT-2 checkpoints in a clean from-scratch PyTorch model, with proof of parity.

One function per command, importable from here (the CLI calls the same ones):

    gpt2port.download(name, revision=None, out=None, dtype=None, force=False, verify=False)   # Hub -> checkpoint
    gpt2port.convert(src, out, dtype=None, force=False, to="gpt2port")                       # local files -> checkpoint
    gpt2port.export(ckpt, out, to="gpt2port" | "hf", dtype=None, force=False)               # checkpoint -> elsewhere
    gpt2port.verify(ckpt, reference=None, dtype=None, tokens=None, hf=True)                 # -> report.passed
    gpt2port.save(model, out, dtype=None, force=False)                                      # model in memory -> checkpoint
"""

__version__ = "0.1.0"

from gpt2port.checkpoint import save  # noqa: E402
from gpt2port.config import GPTConfig  # noqa: E402
from gpt2port.conversion import convert, export  # noqa: E402
from gpt2port.errors import GPT2PortError  # noqa: E402
from gpt2port.hub import download  # noqa: E402
from gpt2port.model import GPT, KVCache  # noqa: E402


def load_tokenizer(ckpt):
    """The checkpoint's GPT-2 BPE as a tiktoken.Encoding, built from its own files (no network)."""
    from gpt2port.tokenizer import load_tokenizer as _load

    return _load(ckpt)


def verify(ckpt, reference=None, dtype=None, tokens=None, hf: bool = True, progress: bool = False):
    """`gpt2port verify`: prove that a converted checkpoint computes what the reference computes (a VerifyReport:
    .passed, .failures, .to_text(), .to_dict())."""
    from gpt2port.verify import run_verify

    return run_verify(ckpt, reference=reference, dtype=dtype, tokens=tokens, progress=progress, hf=hf)


def verify_model(model, reference, **kwargs):
    """Verify a model in memory against a Hugging Face checkpoint (see verify)."""
    from gpt2port.verify import verify_model as _verify_model

    return _verify_model(model, reference, **kwargs)


__all__ = ["GPT", "GPTConfig", "GPT2PortError", "KVCache", "__version__", "convert", "download", "export",
           "load_tokenizer", "save", "verify", "verify_model"]
