"""llama.cpp's GPT-2 layout (GGUF architecture "gpt2"), as its converter writes and its loader expects it.

llama.cpp stores every matrix as nn.Linear does, (out, in) row-major; GGUF lists a tensor's dimensions innermost
first, so its loader's {n_embd, 3*n_embd} for attn_qkv is our (3C, C). No tensor needs a transform. The head is
tied: the loader falls back to token_embd when `output.weight` is absent, which is how it is written by default;
`output.weight`, written on request for older loaders, is accepted on read only if it equals the embedding.
"""

from gpt2port.layouts.table import Layout, Row

ARCH = "gpt2"  # general.architecture, and the prefix of its metadata keys

GGUF = Layout(
    name="gguf",
    rows=(
        Row("tok_emb.weight", "token_embd.weight"),
        Row("pos_emb.weight", "position_embd.weight"),
        Row("blocks.{}.ln1.weight", "blk.{}.attn_norm.weight"),
        Row("blocks.{}.ln1.bias", "blk.{}.attn_norm.bias"),
        Row("blocks.{}.attn.qkv.weight", "blk.{}.attn_qkv.weight"),
        Row("blocks.{}.attn.qkv.bias", "blk.{}.attn_qkv.bias"),
        Row("blocks.{}.attn.proj.weight", "blk.{}.attn_output.weight"),
        Row("blocks.{}.attn.proj.bias", "blk.{}.attn_output.bias"),
        Row("blocks.{}.ln2.weight", "blk.{}.ffn_norm.weight"),
        Row("blocks.{}.ln2.bias", "blk.{}.ffn_norm.bias"),
        Row("blocks.{}.mlp.fc.weight", "blk.{}.ffn_up.weight"),
        Row("blocks.{}.mlp.fc.bias", "blk.{}.ffn_up.bias"),
        Row("blocks.{}.mlp.proj.weight", "blk.{}.ffn_down.weight"),
        Row("blocks.{}.mlp.proj.bias", "blk.{}.ffn_down.bias"),
        Row("final_norm.weight", "output_norm.weight"),
        Row("final_norm.bias", "output_norm.bias"),
    ),
    untied_head="output.weight",
)
