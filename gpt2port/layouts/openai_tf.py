"""OpenAI's original GPT-2 release: TensorFlow variables under `model/`, the layer number glued to `h` (`model/h7/`),
LayerNorm gain and bias as `g` and `b`, and every projection a 1x1 convolution kernel [1, in, out]."""

import re

from gpt2port.layouts.table import Layout, Row
from gpt2port.layouts.transforms import TRANSPOSE, AddDim, Chain

CONV = Chain(TRANSPOSE, AddDim())  # canonical (out, in) -> (in, out) -> [1, in, out]

OPENAI_TF = Layout(
    name="openai-tf",
    rows=(
        Row("tok_emb.weight", "model/wte"),
        Row("pos_emb.weight", "model/wpe"),
        Row("blocks.{}.ln1.weight", "model/h{}/ln_1/g"),
        Row("blocks.{}.ln1.bias", "model/h{}/ln_1/b"),
        Row("blocks.{}.attn.qkv.weight", "model/h{}/attn/c_attn/w", CONV),
        Row("blocks.{}.attn.qkv.bias", "model/h{}/attn/c_attn/b"),
        Row("blocks.{}.attn.proj.weight", "model/h{}/attn/c_proj/w", CONV),
        Row("blocks.{}.attn.proj.bias", "model/h{}/attn/c_proj/b"),
        Row("blocks.{}.ln2.weight", "model/h{}/ln_2/g"),
        Row("blocks.{}.ln2.bias", "model/h{}/ln_2/b"),
        Row("blocks.{}.mlp.fc.weight", "model/h{}/mlp/c_fc/w", CONV),
        Row("blocks.{}.mlp.fc.bias", "model/h{}/mlp/c_fc/b"),
        Row("blocks.{}.mlp.proj.weight", "model/h{}/mlp/c_proj/w", CONV),
        Row("blocks.{}.mlp.proj.bias", "model/h{}/mlp/c_proj/b"),
        Row("final_norm.weight", "model/ln_f/g"),
        Row("final_norm.bias", "model/ln_f/b"),
    ),
    index=re.compile(r"(?<=/h)\d+(?=/)"),
)
