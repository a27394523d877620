"""Which GGML type each GPT-2 tensor takes in a quantized GGUF: llama.cpp's own choice, so that an export is the
file `llama-quantize` writes from the f32 one.

The rules are those of llama.cpp's src/llama-quant.cpp as vendored by llama-cpp-python 0.3.36, for the tensors a
GPT-2 has (no importance matrix, no overrides), after PR #20357 (attn_qkv is an "attn_v-like" tensor: Q6_K on the
"more bits" layers of Q4_K_M/Q5_K_M, Q5_K on the first 4 layers of Q4_K_S):

- vectors (norms, biases) and position_embd are not quantized (written F32);
- the tied token_embd (quantized as the output it also is) and output.weight: Q8_0 where the row width does not
  divide by the file type's block, else Q6_K (Q8_0 files keep Q8_0);
- ffn_down: Q6_K on the "more bits" layers of Q4_K_M and Q5_K_M, Q5_K on the first n_layer/8 of Q4_K_S;
- any other matrix: the file type's own;
- then the fallback for rows that do not divide by 256: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0 (GPT-2 xl, 1600
  wide, keeps a K-quant only in ffn_down). Where even that type cannot take the rows, llama.cpp writes F16; the
  export refuses instead (formats/gguf.write_gguf), as it does for q8_0.
"""

from __future__ import annotations

import re

import gguf

Q = gguf.GGMLQuantizationType
F = gguf.LlamaFileType

# --dtype -> (general.file_type, the type most matrices take)
RECIPES = {
    "q4_0": (F.MOSTLY_Q4_0, Q.Q4_0), "q4_1": (F.MOSTLY_Q4_1, Q.Q4_1),
    "q5_0": (F.MOSTLY_Q5_0, Q.Q5_0), "q5_1": (F.MOSTLY_Q5_1, Q.Q5_1),
    "q8_0": (F.MOSTLY_Q8_0, Q.Q8_0),
    "q4_k_s": (F.MOSTLY_Q4_K_S, Q.Q4_K), "q4_k_m": (F.MOSTLY_Q4_K_M, Q.Q4_K),
    "q5_k_s": (F.MOSTLY_Q5_K_S, Q.Q5_K), "q5_k_m": (F.MOSTLY_Q5_K_M, Q.Q5_K),
    "q6_k": (F.MOSTLY_Q6_K, Q.Q6_K),
}
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}
_LAYER = re.compile(r"blk\.(\d+)\.")


def _more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's use_more_bits: the first and last eighth of the layers and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(key: str, shape: tuple[int, ...], recipe: str, n_layer: int, tied: bool) -> Q:
    """The GGML type of tensor `key` (a matrix of `shape`, not position_embd) in a GGUF of file type `recipe`.
    tied: the file has no output.weight (the head reuses token_embd)."""
    ftype, new = RECIPES[recipe]
    width = shape[-1]
    layer = _LAYER.match(key)
    i = int(layer.group(1)) if layer else -1  # llama.cpp counts these tensors in layer order: the layer index
    if key == "output.weight" or (tied and key == "token_embd.weight"):
        if width % gguf.GGML_QUANT_SIZES[new][0]:
            new = Q.Q8_0
        elif new != Q.Q8_0:
            new = Q.Q6_K
    elif key.endswith("attn_qkv.weight"):
        if ftype in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and _more_bits(i, n_layer):
            new = Q.Q6_K
        elif ftype == F.MOSTLY_Q4_K_S and i < 4:
            new = Q.Q5_K
    elif "ffn_down" in key:
        if ftype in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and _more_bits(i, n_layer):
            new = Q.Q6_K
        elif ftype == F.MOSTLY_Q4_K_S and i < n_layer // 8:
            new = Q.Q5_K
    if width % gguf.GGML_QUANT_SIZES[new][0]:
        new = FALLBACK.get(new, new)
    return new
