"""File formats: bytes on disk <-> named tensors (and metadata key/values), one module per format behind one small
protocol (formats.base).

Nothing here knows what a tensor's name or a metadata key means: that is gpt2port.layouts' (name tables) and
gpt2port.readers' and gpt2port.targets' (a GPT-2 config and tokenizer out of a file, and into one). Adding a format
is adding a module here and a row to readers.READERS.
"""

from gpt2port.formats.base import FLOAT_DTYPES, Reader, TensorInfo

# The weights files of a Hugging Face repo, in order of preference: safetensors cannot run code and streams; .bin
# is the fallback for older repos. Download, conversion and verification all choose by this one list.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")

__all__ = ["FLOAT_DTYPES", "Reader", "TensorInfo", "WEIGHT_FILES"]
