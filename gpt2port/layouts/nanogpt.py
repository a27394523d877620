"""nanoGPT's and minGPT's GPT classes: Hugging Face's names (they were written to load its files), but nn.Linear
weights stored (out, in), so nothing is transposed. A torch.compile'd model saves every key under `_orig_mod.`;
the causal mask is a buffer `attn.bias` when flash attention is off; the head is saved though tied."""

from gpt2port.layouts.hf import HF
from gpt2port.layouts.table import Layout, Row

NANOGPT = Layout(
    name="nanogpt",
    rows=tuple(Row(r.canonical, r.key) for r in HF.rows),  # HF's table, every transform dropped
    dropped=frozenset({"h.{}.attn.bias"}),
    read_prefixes=("_orig_mod.transformer.", "_orig_mod.", "transformer."),
    untied_head="lm_head.weight",
)
