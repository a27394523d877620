"""The stages of a model: everything verify needs to know about the implementation it checks.

Verify runs a model end to end, and also one stage at a time on the float64 reference's own input for that stage
(embeddings, each block's attention and MLP sub-layers, final LayerNorm, head), so that a failure names the first
stage that differs. A `Stages` adapter is the only place that knows how a model class spells those stages:
`GPTStages` serves gpt2port's own GPT; a model class with other attribute names, per-head attention or hand-written
LayerNorms gets verified by writing a subclass of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch


class Stages:
    """A GPT-2-shaped model seen as its stages. Subclasses set the attributes and implement the methods below.

    Every method takes and returns tensors in the model's own dtype, batch first: ids (B, T) int64, hidden states
    (B, T, n_embd), logits (B, T, vocab_size). Attention and MLP return the sub-layer's contribution to the residual
    stream (its LayerNorm included, the residual addition not), as GPT-2's pre-LayerNorm blocks compute
    x + attention(x), then x + mlp(x).
    """

    n_layer: int
    n_head: int
    n_embd: int
    n_positions: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    n_params: int
    # What verify judges the model as, when its parameters' dtype does not say: "int8" for a model quantized at load
    # (gpt2port.quant). None: the dtype's own label.
    precision: str | None = None
    # Whether greedy() decodes through a KV cache (True) or recomputes the whole sequence for every step.
    kv_cached: bool = False
    # The nn.Module behind the stages, where there is one: a diagnosis re-runs a stage in eval mode with it when the
    # model was left in training mode.
    module = None
    # What was done to the model before verify sees it (verification/history.py: biases dropped at load, fine-tuned
    # from a parent, ...): a diagnosis consults it first.
    history: tuple = ()

    def logits(self, ids: torch.Tensor, keep: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """The model's forward as users call it. keep(x), when given, receives the residual stream after the
        embeddings and then after each block, n_layer + 1 calls in order."""
        raise NotImplementedError

    def embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def attention(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def greedy(self, prompt: torch.Tensor, n: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Greedy decoding of a (B, T) prompt: yields (chosen tokens (B,), the (B, vocab) logits that chose them) for
        n steps. This default recomputes the whole sequence each step; a model with a KV cache overrides it (and sets
        kv_cached) so that verify checks the cached path users generate with."""
        ids = prompt
        for _ in range(n):
            logits = self.logits(ids)[:, -1]
            chosen = logits.argmax(-1)
            yield chosen, logits
            ids = torch.cat([ids, chosen[:, None]], dim=1)


class GPTStages(Stages):
    """gpt2port's GPT (gpt2port/model.py) as stages; greedy() is generate.py's own decoding loop over the KV cache."""

    kv_cached = True

    def __init__(self, model):
        cfg = model.config
        self.model = model
        self.n_layer, self.n_head, self.n_embd = cfg.n_layer, cfg.n_head, cfg.n_embd
        self.n_positions, self.vocab_size = cfg.n_positions, cfg.vocab_size
        # The dtype the model computes in: its position table's (an int8 model's matrices are int8, its activations
        # fp32). A local only: a kept parameter would outlive `del model` (and its mapping).
        weight = model.pos_emb.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.precision = getattr(model, "quantized", None)
        self.n_params = model.num_params()
        self.module = model  # diagnosis re-runs a stage in eval mode when the model was left training

    def logits(self, ids, keep=None):
        if keep is None:
            return self.model(ids)[0]
        blocks = self.model.blocks
        hooks = [blocks[0].register_forward_pre_hook(lambda mod, args: keep(args[0].detach()))]
        hooks += [b.register_forward_hook(lambda mod, args, out: keep(out.detach())) for b in blocks]
        try:
            return self.model(ids)[0]
        finally:
            for h in hooks:
                h.remove()

    def embeddings(self, ids):
        return self.model.embed(ids)

    def attention(self, layer, x):
        block = self.model.blocks[layer]
        return block.attn(block.ln1(x))

    def mlp(self, layer, x):
        block = self.model.blocks[layer]
        return block.mlp(block.ln2(x))

    def final_norm(self, x):
        return self.model.final_norm(x)

    def head(self, x):
        return self.model.lm_head(x)

    def greedy(self, prompt, n):
        from gpt2port.generate import decode

        # No stop token: verify continues every row for all n steps, whatever it emits.
        if not getattr(self.model, "quantized", None) or prompt.size(0) == 1:
            return decode(self.model, prompt, n, temperature=0, stop_token=None, check_finite=False)
        # An int8 model multiplies one row on another kernel than several (gpt2port.quant): each prompt decodes alone,
        # as `generate` runs a prompt, so verify judges that kernel (and its smoothing), not the batched one.
        rows = [list(decode(self.model, prompt[i : i + 1], n, temperature=0, stop_token=None, check_finite=False))
                for i in range(prompt.size(0))]
        return ((torch.cat([r[step][0] for r in rows]), torch.cat([r[step][1] for r in rows])) for step in range(n))


def as_stages(model) -> Stages:
    """A Stages adapter as it is, or gpt2port's GPT wrapped in GPTStages."""
    if isinstance(model, Stages):
        return model
    from gpt2port.model import GPT

    if isinstance(model, GPT):
        return GPTStages(model)
    raise TypeError(f"verify needs a gpt2port GPT or a Stages adapter (gpt2port.verification.Stages), "
                    f"not {type(model).__name__}")
