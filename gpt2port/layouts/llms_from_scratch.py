"""The GPTModel class of "Build a Large Language Model (From Scratch)" and the many classes written after it: q, k
and v as three Linears (W_query, W_key, W_value: thirds of GPT-2's fused projection), a hand-written LayerNorm with
`scale` and `shift`, the MLP as a Sequential (layers.0, layers.2), an untied `out_head` that holds a copy of the
token embedding when GPT-2's weights are loaded, and a causal-mask buffer per block."""

from gpt2port.layouts.table import Layout, Row
from gpt2port.layouts.transforms import Part

_QKV = (("W_query", 0), ("W_key", 1), ("W_value", 2))

LLMS_FROM_SCRATCH = Layout(
    name="llms-from-scratch",
    rows=(
        Row("tok_emb.weight", "tok_emb.weight"),
        Row("pos_emb.weight", "pos_emb.weight"),
        Row("blocks.{}.ln1.weight", "trf_blocks.{}.norm1.scale"),
        Row("blocks.{}.ln1.bias", "trf_blocks.{}.norm1.shift"),
        *(Row("blocks.{}.attn.qkv.weight", f"trf_blocks.{{}}.att.{name}.weight", Part(i, 3)) for name, i in _QKV),
        *(Row("blocks.{}.attn.qkv.bias", f"trf_blocks.{{}}.att.{name}.bias", Part(i, 3)) for name, i in _QKV),
        Row("blocks.{}.attn.proj.weight", "trf_blocks.{}.att.out_proj.weight"),
        Row("blocks.{}.attn.proj.bias", "trf_blocks.{}.att.out_proj.bias"),
        Row("blocks.{}.ln2.weight", "trf_blocks.{}.norm2.scale"),
        Row("blocks.{}.ln2.bias", "trf_blocks.{}.norm2.shift"),
        Row("blocks.{}.mlp.fc.weight", "trf_blocks.{}.ff.layers.0.weight"),
        Row("blocks.{}.mlp.fc.bias", "trf_blocks.{}.ff.layers.0.bias"),
        Row("blocks.{}.mlp.proj.weight", "trf_blocks.{}.ff.layers.2.weight"),
        Row("blocks.{}.mlp.proj.bias", "trf_blocks.{}.ff.layers.2.bias"),
        Row("final_norm.weight", "final_norm.scale"),
        Row("final_norm.bias", "final_norm.shift"),
    ),
    dropped=frozenset({"trf_blocks.{}.att.mask"}),
    untied_head="out_head.weight",
)
