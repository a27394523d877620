"""gpt2port's own layout: the canonical names as they are, the tied head stored once (as the token embedding).

A checkpoint's safetensors metadata carries FORMAT_KEY = FORMAT_VERSION; a change to the layout bumps the version,
and readers keep accepting every version listed in READABLE.
"""

from gpt2port.layouts import canonical
from gpt2port.layouts.table import Layout, Row

FORMAT_KEY = "gpt2port_format"
FORMAT_VERSION = "gpt2port/v1"
READABLE = (FORMAT_VERSION,)

GPT2PORT = Layout(
    name="gpt2port",
    rows=tuple(Row(t, t) for t in canonical.TEMPLATES),
    metadata={"format": "pt", FORMAT_KEY: FORMAT_VERSION},
)
