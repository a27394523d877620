"""Hugging Face's GPT-2 layout (GPT2LMHeadModel), as the Hub's files and save_pretrained store it.

The 2019 hub files use bare keys (wte.weight, h.0.attn.c_attn.weight) and carry a causal-mask buffer per layer;
today's save_pretrained writes `transformer.`-prefixed keys and no buffers. Conv1D weights are (in, out).
"""

from gpt2port.layouts.table import Layout, Row
from gpt2port.layouts.transforms import TRANSPOSE

HF = Layout(
    name="hf",
    rows=(
        Row("tok_emb.weight", "wte.weight"),
        Row("pos_emb.weight", "wpe.weight"),
        Row("blocks.{}.ln1.weight", "h.{}.ln_1.weight"),
        Row("blocks.{}.ln1.bias", "h.{}.ln_1.bias"),
        Row("blocks.{}.attn.qkv.weight", "h.{}.attn.c_attn.weight", TRANSPOSE),
        Row("blocks.{}.attn.qkv.bias", "h.{}.attn.c_attn.bias"),
        Row("blocks.{}.attn.proj.weight", "h.{}.attn.c_proj.weight", TRANSPOSE),
        Row("blocks.{}.attn.proj.bias", "h.{}.attn.c_proj.bias"),
        Row("blocks.{}.ln2.weight", "h.{}.ln_2.weight"),
        Row("blocks.{}.ln2.bias", "h.{}.ln_2.bias"),
        Row("blocks.{}.mlp.fc.weight", "h.{}.mlp.c_fc.weight", TRANSPOSE),
        Row("blocks.{}.mlp.fc.bias", "h.{}.mlp.c_fc.bias"),
        Row("blocks.{}.mlp.proj.weight", "h.{}.mlp.c_proj.weight", TRANSPOSE),
        Row("blocks.{}.mlp.proj.bias", "h.{}.mlp.c_proj.bias"),
        Row("final_norm.weight", "ln_f.weight"),
        Row("final_norm.bias", "ln_f.bias"),
    ),
    # Causal-mask buffers of the 2019 files: the model rebuilds the mask, so they carry nothing.
    dropped=frozenset({"h.{}.attn.bias", "h.{}.attn.masked_bias"}),
    read_prefixes=("transformer.",),
    write_prefix="transformer.",  # what save_pretrained writes today
    untied_head="lm_head.weight",  # GPT-2 ties it to wte; transformers re-ties it on load, so it is never written
    metadata={"format": "pt"},
)
