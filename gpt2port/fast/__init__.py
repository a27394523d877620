"""gpt2port.fast: decoding speed, added to the plain model from outside and never required by it.

    from gpt2port import GPT
    from gpt2port.fast import Settings, accelerate
    model = accelerate(GPT.from_pretrained("checkpoints/gpt2"))      # swaps kernels in; builds them once per machine

What is here, one module per concern:
- settings.py  Settings: which accelerations to use, passed explicitly (`generate` takes one).
- native.py    gpt2port's own C kernels (matvec.c: one row times a weight; attention.c: attention for one new
               token; int4.c: 4-bit weights; layers.c: LayerNorm and GPT-2's GELU on one row), built on purpose into
               a per-machine cache and registered as torch.ops.gpt2port.*.
- int4.py      the int4 kernel checked before use, its quantizer, and the loader of an int4 model (gpt2port.quant4).
- kernels.py   `choose`, the one function that picks each product's kernel, and `accelerate`, which replaces the
               model's linear layers by ones that use it (same Parameters, same product), its dropouts by ones
               that skip F.dropout out of training, its LayerNorms by ones that take one row on layers.c, and the
               MLPs' tanh GELU by the same function on layers.c.
- cache.py     the KV cache generation hands the model: one new token's attention on gpt2port's kernel where it
               computes what model.KVCache.attend does.
- graph.py     the decode step: the model's own forward; for one row on the CPU replayed from C++ by default (or
               compiled ahead of time, package.py), on a GPU optionally recorded as a CUDA graph.
- replay.py    a forward's operator calls recorded as it runs, made into a program replay.cpp calls again.
- speed.py     the memory-bandwidth floor that decode rates are compared with.
- doctor.py    `gpt2port doctor`: builds the kernels and says what generation will run on.

Nothing here computes any part of the model a second time: every step is GPT.forward, with layers and a cache that
compute the same on faster kernels. Without this package (or with every Settings field off, or the C build failed),
the model computes the same numbers on PyTorch's own kernels, slower.
"""

from gpt2port.fast.kernels import accelerate, choose, restore
from gpt2port.fast.settings import OFF, Settings
from gpt2port.fast.graph import decode_step

__all__ = ["OFF", "Settings", "accelerate", "choose", "decode_step", "restore"]
