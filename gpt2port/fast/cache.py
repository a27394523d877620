"""The KV cache generation hands the model: model.KVCache, with attention for one new token of one unpadded row on
gpt2port's kernel (attention.c, torch.ops.gpt2port.attend_one), which also writes the new key and value into the
cache. The model's attention calls `cache.attend` for its arithmetic over the cache; this cache answers the one case
the kernel serves (the position a number, or a one-element tensor that the kernel reads when it runs: a captured
forward's) and leaves every other (a prompt, a batch, padding, autograd) to KVCache.

The kernel stands in for KVCache.attend only where it computes the same: before it is used it is run beside
KVCache.attend (the code in model.py as it is now, edits included) on random numbers at the cache's own shapes, at
the first and the last position, and where the two disagree the cache keeps to KVCache.attend and says why.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from gpt2port.fast import native
from gpt2port.fast.settings import Settings
from gpt2port.model import KVCache


class KernelCache(KVCache):
    """KVCache whose attend() runs one token of one unpadded row on gpt2port's kernel (see the module's docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # numbers, not sizes read from q (which a capture records, and replays the arithmetic of, every step)
        self.heads, self.head_dim = int(self.k.size(2)), int(self.k.size(4))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos, scale):
        # pos a number, or a one-element tensor (a captured forward's: the kernel reads it at each replay)
        at = pos < self.max_len if isinstance(pos, int) else _position(pos)
        if at and q.size(0) == 1 and q.size(2) == 1 and self.pad is None and q.dtype == self.k.dtype and \
                not torch.is_grad_enabled():
            H, D = self.heads, self.head_dim
            C = H * D
            # views of the row the model's qkv layer wrote: attend_one reads it as it is (torch.compile cannot see
            # where a tensor lies: there the three are joined)
            if not torch.compiler.is_compiling() and _adjacent(q, k, v, C):
                qkv = q.as_strided((3 * C,), (1,))
            else:
                qkv = torch.cat((q, k, v)).view(-1)  # (3, H, 1, D): q, k, v in the layout attend_one reads
            # named overloads: a one-element tensor would pass for the number too, and be captured as a constant
            attend = torch.ops.gpt2port.attend_one.default if isinstance(pos, int) else torch.ops.gpt2port.attend_one.at
            y = attend(qkv, self.k[layer], self.v[layer], pos, scale)
            return y.view(1, 1, H, D).transpose(1, 2)  # (1, H, 1, D), as SDPA returns it
        return super().attend(layer, q, k, v, pos, scale)


def _position(pos) -> bool:
    """Whether pos is a position the kernel reads from a tensor: one int64 number on the CPU."""
    return isinstance(pos, torch.Tensor) and pos.numel() == 1 and pos.dtype == torch.long and pos.device.type == "cpu"


def _adjacent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, C: int) -> bool:
    """Whether q, k and v (1, H, 1, D) lie one right after the other, each contiguous, within q's own storage (so
    that a view of it spans all three)."""
    size = q.element_size()
    at, end = q.data_ptr(), (q.storage_offset() + 3 * C) * size
    return k.data_ptr() == at + C * size and v.data_ptr() == at + 2 * C * size and \
        q.untyped_storage().nbytes() >= end and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()


def new_cache(config, batch_size: int, max_len: int, dtype, device, pad: torch.Tensor | None,
              settings: Settings) -> tuple[KVCache, str]:
    """The cache for a generation, and what its attention for one new token runs on (for `generate -v`)."""
    why = _why_not_kernel(config, batch_size, max_len, dtype, device, pad, settings)
    if why is not None:
        return KVCache(config, batch_size, max_len, dtype, device, pad), f"attention on SDPA ({why})"
    return KernelCache(config, batch_size, max_len, dtype, device, pad), "attention on gpt2port's kernel"


def _why_not_kernel(config, batch_size, max_len, dtype, device, pad, settings: Settings) -> str | None:
    if not (settings.native and settings.attend_one):
        return "switched off"
    if batch_size != 1 or (pad is not None and bool(pad.any())):
        return "a batch: the kernel takes one unpadded row"
    if torch.device(device or "cpu").type != "cpu" or dtype not in native.FUNCTIONS:
        return f"{dtype} on {device}: the kernel takes fp32 or bf16 on the CPU"
    built = native.kernels()
    if not built.attend_one:
        return built.binding_why_not or "not built"
    if not agrees(config.n_head, config.head_dim, max_len, dtype):
        return "model.py's KVCache.attend computes something else than the kernel"
    return None


@functools.cache
def agrees(H: int, D: int, max_len: int, dtype: torch.dtype) -> bool:
    """Whether the kernel computes what KVCache.attend does for one new token, at positions 0 and max_len - 1 over
    random keys and values (a private generator), with the default scale and with 1.0, the position a number and a
    one-element tensor: output and cache alike."""
    g = torch.Generator().manual_seed(0)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    shape = SimpleNamespace(n_layer=1, n_head=H, head_dim=D, n_positions=max_len)  # all a KVCache reads

    with torch.inference_mode():
        for pos in [p for at in sorted({0, max_len - 1}) for p in (at, torch.tensor([at]))]:
            for scale in (None, 1.0):
                caches = [KVCache(shape, 1, max_len, dtype), KernelCache(shape, 1, max_len, dtype)]
                keys, values = (torch.randn(1, 1, H, max_len, D, generator=g).to(dtype) for _ in range(2))
                q, k, v = (torch.randn(1, H, 1, D, generator=g).to(dtype) for _ in range(3))
                got = []
                for c in caches:
                    c.k.copy_(keys)
                    c.v.copy_(values)
                    got.append(c.attend(0, q, k, v, pos, scale).float())
                if got[0].shape != got[1].shape or not torch.allclose(got[0], got[1], rtol=tolerance, atol=tolerance) \
                        or not (torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)):
                    return False
    return True
