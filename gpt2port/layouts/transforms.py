"""How a tensor's storage in some layout differs from its canonical form, as small objects that know their inverse.

Every transform maps a canonical tensor to the layout's (`to_layout`) and back (`from_layout`), and says what
shape the layout stores (`layout_shape`). Canonical tensors are in nn.Linear (out, in) layout. `Part` is the one
transform that is not invertible tensor by tensor: several layout tensors (q, k and v; or one per head) are parts
of one canonical tensor, so reading them back is a `merge` of all the parts.
"""

from __future__ import annotations

import torch

from gpt2port.errors import GPT2PortError

Shape = tuple[int, ...]


class Transform:
    name = "identity"
    # False where the stored shape hides the canonical one (padding), so the tensor cannot tell a model's size.
    exact_shape = True
    # True where the layout stores the canonical tensor's bytes in the same order (only the shape may differ), so a
    # converter may copy them from file to file without holding the tensor. Only the identity and AddDim say so.
    keeps_bytes = False

    def to_layout(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def from_layout(self, t: torch.Tensor, canonical_shape: Shape) -> torch.Tensor:
        return t

    def layout_shape(self, canonical_shape: Shape) -> Shape:
        return tuple(canonical_shape)

    def canonical_shape(self, layout_shape: Shape) -> Shape:
        """The inverse of layout_shape, for telling a model's size from a file's shapes."""
        return tuple(layout_shape)

    def __repr__(self) -> str:
        return self.name


class Identity(Transform):
    keeps_bytes = True


IDENTITY = Identity()


class Transpose(Transform):
    """HF's Conv1D stores a linear map (in, out); nn.Linear stores (out, in). Square matrices (attn.c_proj) pass any
    shape check untransposed, which is why the layout tables, not shapes, decide."""

    name = "transpose"

    def to_layout(self, t):
        return t.t()

    def from_layout(self, t, canonical_shape):
        return t.t()

    def layout_shape(self, canonical_shape):
        return tuple(reversed(canonical_shape))

    def canonical_shape(self, layout_shape):
        return tuple(reversed(layout_shape))


TRANSPOSE = Transpose()


class AddDim(Transform):
    """The layout keeps a leading axis of size 1 (TensorFlow's Conv1D weights are [1, in, out])."""

    name = "add_dim"
    keeps_bytes = True

    def to_layout(self, t):
        return t.unsqueeze(0)

    def from_layout(self, t, canonical_shape):
        if t.shape[0] != 1:
            raise GPT2PortError(f"expected a leading axis of size 1, got shape {tuple(t.shape)}")
        return t.squeeze(0)

    def layout_shape(self, canonical_shape):
        return (1, *canonical_shape)

    def canonical_shape(self, layout_shape):
        return tuple(layout_shape[1:])


class PadRows(Transform):
    """The layout pads the rows up to a multiple (llm.c rounds the vocabulary to 128 rows for its kernels); the pad
    rows are zeros, and reading drops them."""

    def __init__(self, multiple: int):
        self.multiple = multiple
        self.name = f"pad_rows({multiple})"
        self.exact_shape = False

    def layout_shape(self, canonical_shape):
        rows = -(-canonical_shape[0] // self.multiple) * self.multiple
        return (rows, *canonical_shape[1:])

    def canonical_shape(self, layout_shape):
        return tuple(layout_shape)  # the padding is not visible in the shape: an upper bound

    def to_layout(self, t):
        extra = self.layout_shape(tuple(t.shape))[0] - t.shape[0]
        return torch.cat([t, t.new_zeros((extra, *t.shape[1:]))]) if extra else t

    def from_layout(self, t, canonical_shape):
        return t[: canonical_shape[0]]


class Part(Transform):
    """The layout stores part `index` of `count` equal slices of the canonical tensor along its first axis: q, k or
    v of the fused qkv projection (count 3), or one head of them (count 3 x n_head)."""

    def __init__(self, index: int, count: int):
        self.index, self.count = index, count
        self.name = f"part({index}/{count})"

    def layout_shape(self, canonical_shape):
        if canonical_shape[0] % self.count:
            raise GPT2PortError(f"cannot cut {canonical_shape[0]} rows into {self.count} equal parts")
        return (canonical_shape[0] // self.count, *canonical_shape[1:])

    def canonical_shape(self, layout_shape):
        return (layout_shape[0] * self.count, *layout_shape[1:])

    def to_layout(self, t):
        size = t.shape[0] // self.count
        return t[self.index * size:(self.index + 1) * size]

    def from_layout(self, t, canonical_shape):
        raise GPT2PortError(f"{self.name}: one part cannot be read back alone; merge all {self.count} parts")


class Chain(Transform):
    """Transforms applied in order on the way to the layout, and undone in reverse order on the way back."""

    def __init__(self, *steps: Transform):
        self.steps = steps
        self.name = "+".join(s.name for s in steps)
        self.keeps_bytes = all(s.keeps_bytes for s in steps)

    def to_layout(self, t):
        for s in self.steps:
            t = s.to_layout(t)
        return t

    def _shapes(self, canonical_shape: Shape) -> list[Shape]:
        shapes = [tuple(canonical_shape)]
        for s in self.steps:
            shapes.append(s.layout_shape(shapes[-1]))
        return shapes

    def layout_shape(self, canonical_shape):
        return self._shapes(canonical_shape)[-1]

    def canonical_shape(self, layout_shape):
        for s in reversed(self.steps):
            layout_shape = s.canonical_shape(layout_shape)
        return tuple(layout_shape)

    def from_layout(self, t, canonical_shape):
        shapes = self._shapes(canonical_shape)
        for s, shape in zip(reversed(self.steps), reversed(shapes[:-1])):
            t = s.from_layout(t, shape)
        return t


def split_part(transform: Transform) -> tuple[Part | None, Transform]:
    """(the Part a transform begins with, or None; what follows it)."""
    if isinstance(transform, Part):
        return transform, IDENTITY
    if isinstance(transform, Chain) and transform.steps and isinstance(transform.steps[0], Part):
        rest = transform.steps[1:]
        return transform.steps[0], (Chain(*rest) if len(rest) > 1 else rest[0] if rest else IDENTITY)
    return None, transform


def merge(parts: list[tuple[Transform, torch.Tensor]], canonical_shape: Shape) -> torch.Tensor:
    """One canonical tensor from layout tensors: a single whole one, or every Part of it, each first brought back
    through the rest of its transform."""
    if len(parts) == 1 and split_part(parts[0][0])[0] is None:
        transform, t = parts[0]
        return transform.from_layout(t, canonical_shape)
    pieces = {}
    for transform, t in parts:
        part, rest = split_part(transform)
        if part is None:
            raise GPT2PortError(f"a whole tensor ({transform}) cannot be merged with parts")
        pieces[part.index] = rest.from_layout(t, part.layout_shape(canonical_shape))
        count = part.count
    if sorted(pieces) != list(range(count)):
        raise GPT2PortError(f"parts {sorted(pieces)} of {count} cannot make a whole tensor")
    return torch.cat([pieces[i] for i in range(count)])
