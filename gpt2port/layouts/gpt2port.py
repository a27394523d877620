"""gpt2port's own layout: the canonical names as they are, the tied head stored once (as the token embedding).

A checkpoint's safetensors metadata carries FORMAT_KEY = its format version; a change to the layout bumps the
version, and readers keep accepting every version listed in READABLE:
  gpt2port/v1  GPT-2's tensors, the head tied to the token embedding (stored once, as tok_emb.weight).
  gpt2port/v2  v1 plus a head of its own: lm_head.weight, and tie_word_embeddings false in config.json (a model
               fine-tuned with an untied head). A tied model is still written as v1, byte for byte as before, so
               the checkpoints most people have stay readable by earlier versions of gpt2port.
"""

from gpt2port.layouts import canonical
from gpt2port.layouts.table import Layout, Row

FORMAT_KEY = "gpt2port_format"
FORMAT_VERSION = "gpt2port/v1"
FORMAT_UNTIED = "gpt2port/v2"
READABLE = (FORMAT_VERSION, FORMAT_UNTIED)

GPT2PORT = Layout(
    name="gpt2port",
    rows=tuple(Row(t, t) for t in canonical.TEMPLATES),
    untied_head=canonical.HEAD,
    metadata={"format": "pt", FORMAT_KEY: FORMAT_VERSION},
)


def metadata_for(config) -> dict[str, str]:
    """The safetensors metadata of a checkpoint of this model: v2 only where it needs v2 (an untied head)."""
    return {**GPT2PORT.metadata, FORMAT_KEY: FORMAT_VERSION if config.tie_word_embeddings else FORMAT_UNTIED}
