"""int8 weight-only inference: GPT.from_pretrained(path, dtype="int8") and `generate --dtype int8`.

Every matrix of the model (the four per block, and the token embedding, which is also the tied head) is stored as
int8 with one fp32 scale per output row: w ~= q * scale, scale = max|row| / 127, q = round(w / scale). Symmetric,
per output channel, so the head's rows and the embedding's rows are the same rows with the same scales: the tied
matrix is stored once. Norms, biases and the position table stay fp32 (they are small, and they set the scale
of everything downstream).

The products run on PyTorch's own int8 weight-packed kernel (`torch._weight_int8pack_mm`), which reads the int8
weight and scales each output by its row's scale: a decode step streams a quarter of the fp32 bytes. The kernel
takes its activations in a 16-bit float, ACTIVATION_DTYPE; everything between the products stays fp32.

Quantization happens at load, from the checkpoint's memory-mapped tensors in whatever dtype they are stored, one
matrix at a time: peak memory is the int8 model plus one matrix in fp32, never the fp32 model.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt2port.errors import GPT2PortError

INT8 = "int8"
# fp16 keeps 3 more mantissa bits than bf16, and GPT-2's activations stay far inside fp16's range.
ACTIVATION_DTYPE = torch.float16


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 (N, K), scale fp32 (N,)) with w ~= q * scale[:, None]; an all-zero row gets scale 1 (q is 0)."""
    w = w.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T + bias, computed by PyTorch's int8 weight-packed kernel."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("kernel_scale", scale.to(ACTIVATION_DTYPE))  # the kernel wants it in x's dtype
        self.register_buffer("bias", None if bias is None else bias.float())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> "Int8Linear":
        return cls(*quantize_rows(weight), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(ACTIVATION_DTYPE)
        y = torch._weight_int8pack_mm(rows, self.weight, self.kernel_scale).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight this layer computes with (for checks and for verify's stage comparisons)."""
        return self.weight.float() * self.scale[:, None]


class Int8Embedding(nn.Module):
    """Rows of an int8 matrix, scaled back to fp32 on lookup; shares its matrix with the tied head."""

    def __init__(self, table: Int8Linear):
        super().__init__()
        self.table = table  # not a copy: the same buffers as the head

    @property
    def weight(self) -> torch.Tensor:  # the model's device and dtype queries look here, as on nn.Embedding
        return self.table.scale

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.table.weight).float() * self.table.scale[idx].unsqueeze(-1)


def linear_names(model: nn.Module) -> list[str]:
    """The model's Linear layers by module name (the matrices that become int8), head last."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def quantized_model(cls, path, device=None):
    """A GPT whose matrices are int8 (see the module's docstring), built from the checkpoint at `path`."""
    from gpt2port.checkpoint import load_state

    if device is not None and torch.device(device).type != "cpu":
        raise GPT2PortError(f"dtype int8 runs on the CPU (PyTorch's int8 kernel); got device {device}")
    if not hasattr(torch, "_weight_int8pack_mm"):
        raise GPT2PortError(f"dtype int8 needs PyTorch's int8 weight-packed kernel (PyTorch >= 2.3; "
                            f"this is {torch.__version__})")
    ckpt_dir, config, state = load_state(path)  # memory-mapped, in the stored dtype: nothing read yet
    if not config.tie_word_embeddings:
        raise GPT2PortError(f"{ckpt_dir}: dtype int8 supports GPT-2's tied head; this checkpoint's head is separate")
    with torch.device("meta"):
        model = cls(config)
    names = linear_names(model)
    for name in names:
        if name == "lm_head":
            continue
        owner, attr = _owner(model, name)
        setattr(owner, attr, Int8Linear.from_float(state.pop(f"{name}.weight"), state.pop(f"{name}.bias", None)))
    head = Int8Linear.from_float(state.pop("tok_emb.weight"), None)
    model.lm_head, model.tok_emb = head, Int8Embedding(head)
    rest = {k: v.float() for k, v in state.items()}  # norms, biases left, the position table
    missing, unexpected = model.load_state_dict(rest, assign=True, strict=False)
    unloaded = [k for k in missing if not k.startswith(("lm_head.", "tok_emb.", *(f"{n}." for n in names)))]
    if unloaded or unexpected:
        raise GPT2PortError(f"{ckpt_dir}: internal error quantizing: unloaded {unloaded}, unexpected {unexpected}")
    model.checkpoint_dir = ckpt_dir
    model.quantized = INT8
    return model.eval()


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, attr = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), attr
