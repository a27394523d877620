"""llm.c's GPT-2 layout (karpathy/llm.c, gpt2_*.bin): nn.Linear (out, in) matrices like the canonical set, but the
token embedding padded with zero rows to a multiple of 128, and the tensors grouped by kind across layers.

llm.c's files carry no names: a tensor is known by its place. The names here (`wte`, `h.3.qkvw`, ...) follow the
fields of llm.c's ParameterTensors and exist so the tables, messages and tests can speak of each tensor.
"""

from gpt2port.layouts.table import Layout, Row, Write, template
from gpt2port.layouts.transforms import PadRows

# llm.c pads the vocabulary so its matmuls see friendly sizes (50257 -> 50304 for GPT-2).
VOCAB_MULTIPLE = 128

_PER_LAYER = (
    ("ln1.weight", "ln1w"), ("ln1.bias", "ln1b"), ("attn.qkv.weight", "qkvw"), ("attn.qkv.bias", "qkvb"),
    ("attn.proj.weight", "attprojw"), ("attn.proj.bias", "attprojb"), ("ln2.weight", "ln2w"), ("ln2.bias", "ln2b"),
    ("mlp.fc.weight", "fcw"), ("mlp.fc.bias", "fcb"), ("mlp.proj.weight", "fcprojw"), ("mlp.proj.bias", "fcprojb"),
)

ROWS = (
    Row("tok_emb.weight", "wte", PadRows(VOCAB_MULTIPLE)),
    Row("pos_emb.weight", "wpe"),
    *(Row(f"blocks.{{}}.{name}", f"h.{{}}.{kind}") for name, kind in _PER_LAYER),
    Row("final_norm.weight", "lnfw"),
    Row("final_norm.bias", "lnfb"),
)

# The 16 kinds in the order llm.c's ParameterTensors lists them: its file holds every layer's tensor of one kind
# before the next kind begins.
KINDS = tuple(template(row.key)[0].removeprefix("h.{}.") for row in ROWS)


def kind_and_layer(key: str) -> tuple[str, int]:
    tpl, idx = template(key)
    return tpl.removeprefix("h.{}."), (idx[0] if idx else 0)


def file_order(writes: list[Write]) -> list[Write]:
    """Grouped by kind (in KINDS order), then by layer."""
    def rank(w: Write) -> tuple[int, int]:
        kind, layer = kind_and_layer(w.key)
        return KINDS.index(kind), layer

    return sorted(writes, key=rank)


LLMC = Layout(name="llmc", rows=ROWS, order=file_order)


def padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
