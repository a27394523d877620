"""An independent float64 GPT-2 computed straight from Hugging Face files: the truth `gpt2port verify` measures against.

It deliberately shares no code with gpt2port's converter (sources.py, keymap.py) or model (model.py): it reads the
HF files with the official `safetensors` library (or `torch.load(weights_only=True)` for .bin), keeps every weight
in HF's native Conv1D (in, out) layout, reads the HF config.json itself, and writes out every operation in float64.
A mapping bug in the converter therefore cannot hide by being repeated here.

Weights are read one block at a time and dropped after use, so even gpt2-xl needs well under 2 GB beyond the
activations. All inputs advance through a block together, so each block's weights are read once per run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from gpt2port import inputs
from gpt2port.activations import TABLE
from gpt2port.errors import GPT2PortError
from gpt2port.formats import WEIGHT_FILES
from gpt2port.formats.shards import INDEX_SUFFIX, shard_names
from gpt2port.formats.torch_pickle import load_state_dict

# --- which files hold the weights ----------------------------------------------------------------------------------
# Which files to open is bytes, not meaning: the reference shares the package's one list of HF weight files and its
# one (path-checking) shard-index reader. What the tensors mean, it works out on its own below.


def weight_files(path: Path) -> list[Path]:
    """The weights files of a local HF GPT-2 (a directory, a weights file or a shard index), shards in index order."""
    if path.is_file():
        return _shards(path) if path.name.endswith(INDEX_SUFFIX) else [path]
    if not path.is_dir():
        raise GPT2PortError(f"{path}: reference not found (a Hugging Face GPT-2 directory or weights file)")
    for name in WEIGHT_FILES:
        f = path / name
        if f.is_file():
            return _shards(f) if name.endswith(INDEX_SUFFIX) else [f]
    raise GPT2PortError(f"{path}: no GPT-2 weights for the reference (looked for {', '.join(WEIGHT_FILES)})")


def _shards(index: Path) -> list[Path]:
    return [index.parent / name for name in shard_names(index)]


# --- the tensors and the forward ---------------------------------------------------------------------------------

PREFIX = "transformer."  # save_pretrained's prefix; the 2019 hub files have bare keys

# n_embd -> n_head of the four official sizes: only used when a bare weights file comes without config.json.
OFFICIAL_HEADS = {768: 12, 1024: 16, 1280: 20, 1600: 25}


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    # GPT-2's own GELU: the tanh approximation from the original TF code (HF: gelu_new / gelu_pytorch_tanh / gelu_fast)
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def _gelu_erf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


# its own formulas (written out, in float64), under the names of activations.py's table
_FORMULAS = {
    "gelu_new": _gelu_tanh,
    "gelu": _gelu_erf,
    "relu": lambda x: x.clamp_min(0.0),
    "silu": lambda x: x * torch.sigmoid(x),
}
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    name: _FORMULAS[a.same_as or name] for name, a in TABLE.items()}


@dataclass(frozen=True)
class RefConfig:
    """What the forward needs, read from HF's config.json with HF's defaults."""

    n_layer: int
    n_head: int
    n_embd: int
    n_positions: int
    vocab_size: int
    eps: float
    activation: str
    scale_attn: bool  # divide scores by sqrt(head_dim)
    inverse_layer_scale: bool  # also divide by layer index + 1 (scale_attn_by_inverse_layer_idx)
    tied: bool  # head = wte (tie_word_embeddings); otherwise lm_head.weight


@dataclass
class Stage:
    """Intermediate values of one stage for every input, handed to an observer and dropped afterwards.

    kind "embeddings": values["out"]; kind "block": values "in", "attn" (attention sub-output), "mid" (residual after
    attention), "mlp" (MLP sub-output), "out" (residual after the block); kind "final": values "in" (residual after
    the last block), "out" (after the final LayerNorm). Each value is a list with one float64 tensor per input.
    """

    kind: str
    layer: int | None
    values: dict[str, list[torch.Tensor]]
    # the weights the stage used (a block's, as _block gives them; wte/wpe; ln_f), for re-running it with a change
    weights: dict[str, torch.Tensor] | None = None


class HFFiles:
    """The tensors of a local HF GPT-2 checkpoint (directory or weights file), by bare key, read one at a time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.root = self.path if self.path.is_dir() else self.path.parent
        self.files = weight_files(self.path)
        self._where: dict[str, tuple[Path, str]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._open: dict[Path, object] = {}
        for f in self.files:
            handle = self._handle(f)
            for key in handle.keys():
                bare = key[len(PREFIX):] if key.startswith(PREFIX) else key
                if bare not in self._where:
                    self._where[bare] = (f, key)
                    self._shapes[bare] = tuple(handle.get_slice(key).get_shape())

    def _handle(self, f: Path):
        """A reader for f. A safetensors file is opened afresh for each read and closed after it: the library
        memory-maps the whole file, and the pages a read touches stay resident (and counted in RSS) for as long as
        the mapping lives; at gpt2-xl that would be another 6 GB beside the model under test."""
        if f in self._open:
            return self._open[f]
        if not f.is_file():
            raise GPT2PortError(f"{f}: reference weights file missing")
        try:
            if f.suffix == ".safetensors":
                from safetensors import safe_open

                return safe_open(str(inputs.checked(f)), framework="pt")
            self._open[f] = _BinFile(f)
        except GPT2PortError:
            raise
        except Exception as e:  # noqa: BLE001 - any library failure becomes one line naming the file
            raise GPT2PortError(f"{f}: cannot read reference weights ({e})") from None
        return self._open[f]

    def has(self, key: str) -> bool:
        return key in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        """A tensor's shape, from the file's header: nothing is read."""
        self._where_of(key)
        return self._shapes[key]

    def _where_of(self, key: str) -> tuple[Path, str]:
        if key not in self._where:
            raise GPT2PortError(f"{', '.join(str(f) for f in self.files)}: reference tensor {key!r} not found")
        return self._where[key]

    def _read(self, key: str) -> torch.Tensor:
        """The tensor as the library hands it out: for safetensors, a view into that read's own file mapping."""
        f, key_in_file = self._where_of(key)
        return self._handle(f).get_tensor(key_in_file)

    def get(self, key: str) -> torch.Tensor:
        """The tensor under its bare key (e.g. 'h.3.attn.c_attn.weight'), in the file's dtype and HF's layout; a
        copy of its own, so that no file mapping outlives the read."""
        return self._read(key).clone()

    def get64(self, key: str) -> torch.Tensor:
        return self._read(key).to(torch.float64, copy=True)

    def config_dict(self) -> dict:
        """config.json beside the weights ({} if there is none)."""
        path = self.root / "config.json"
        if not path.is_file():
            return {}
        return inputs.read_json(path)

    def close(self) -> None:
        self._open.clear()


class _Shaped:
    def __init__(self, t: torch.Tensor):
        self.t = t

    def get_shape(self) -> list[int]:
        return list(self.t.shape)


class _BinFile:
    """pytorch_model.bin behind the same keys()/get_tensor() face as safe_open. weights_only: a pickle cannot run
    code; mmap: tensors stay on disk until used (not possible for the pre-zip legacy format). Unlike a safetensors
    file it stays open for the whole run (reloading it per read would re-parse the pickle each time), so the pages
    read stay mapped: a .bin reference costs up to one more copy of the weights in RSS."""

    def __init__(self, f: Path):
        self._sd = load_state_dict(f)  # the one pickle loader: its refusal never relays torch's weights_only=False

    def keys(self):
        return list(self._sd)

    def get_slice(self, key: str) -> "_Shaped":  # safe_open's face, for the shape
        return _Shaped(self._sd[key])

    def get_tensor(self, key: str) -> torch.Tensor:
        return self._sd[key]


def read_config(files: HFFiles) -> RefConfig:
    """HF's config.json beside the weights (HF defaults for absent fields); shapes decide when there is none."""
    path = files.root / "config.json"
    hf = files.config_dict()
    vocab_size, width = files.shape("wte.weight")
    n_embd = int(hf.get("n_embd", width))
    n_layer = int(hf["n_layer"]) if "n_layer" in hf else sum(1 for k in files.keys() if k.endswith(".ln_1.weight"))
    if "n_head" in hf:
        n_head = int(hf["n_head"])
    elif n_embd in OFFICIAL_HEADS:
        n_head = OFFICIAL_HEADS[n_embd]
    else:
        raise GPT2PortError(f"{path}: missing; the reference needs it to know n_head for width {n_embd}")
    activation = hf.get("activation_function", "gelu_new")
    if activation not in ACTIVATIONS:
        raise GPT2PortError(f"{path}: activation_function {activation!r} is not implemented by the float64 reference")
    if hf.get("add_cross_attention"):
        raise GPT2PortError(f"{path}: add_cross_attention=true is not implemented by the float64 reference")
    return RefConfig(
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        n_positions=int(hf.get("n_positions", hf.get("n_ctx") or files.shape("wpe.weight")[0])),
        vocab_size=int(vocab_size),
        eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        activation=activation,
        scale_attn=bool(hf.get("scale_attn_weights", True)),
        inverse_layer_scale=bool(hf.get("scale_attn_by_inverse_layer_idx", False)),
        tied=bool(hf.get("tie_word_embeddings", True)) or not files.has("lm_head.weight"),
    )


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               unbiased: bool = False) -> torch.Tensor:
    """unbiased=True is a known mistake (torch.var's default), kept here so diagnosis can re-run it."""
    mean = x.mean(dim=-1, keepdim=True)
    n = x.shape[-1] - 1 if unbiased else x.shape[-1]
    var = (x - mean).pow(2).sum(dim=-1, keepdim=True) / n  # biased variance, as LayerNorm defines it
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


class Float64GPT2:
    """GPT-2's forward over the raw HF tensors, in float64. Usage:

        with Float64GPT2("path/to/hf-repo") as ref:
            logits = ref.forward([ids_a, ids_b], observe=print)   # one (B, T, vocab) float64 tensor per input
    """

    def __init__(self, path: str | Path, files=None):
        """path: an HF directory or weights file, OpenAI's TensorFlow release, or a gpt2port checkpoint directory
        (its own weights); files: tensors already at hand behind HFFiles' face (reference_canonical.py)."""
        self.path = Path(path)
        from gpt2port.verification.reference_canonical import checkpoint_files, is_gpt2port_checkpoint
        from gpt2port.verification.reference_tf import TFFiles, is_tf  # OpenAI's original TensorFlow release

        if files is None:
            files = checkpoint_files(self.path) if is_gpt2port_checkpoint(self.path) else \
                TFFiles(path) if is_tf(self.path) else HFFiles(path)
        self.files = files
        self.config = read_config(self.files)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.files.close()

    def _block(self, i: int) -> dict[str, torch.Tensor]:
        names = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                 "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                 "mlp.c_proj.weight", "mlp.c_proj.bias")
        return {n: self.files.get64(f"h.{i}.{n}") for n in names}

    def _embed(self, inputs, wte, wpe) -> list[torch.Tensor]:
        out = []
        for ids in inputs:
            T = ids.shape[-1]
            if T > self.config.n_positions:
                raise GPT2PortError(f"input of {T} tokens exceeds the reference's {self.config.n_positions} positions")
            out.append(wte[ids].to(torch.float64) + wpe[:T].to(torch.float64))
        return out

    def attention(self, x: torch.Tensor, w: dict[str, torch.Tensor], layer: int, scale: float | None = None,
                  mask_shift: int = 0, swap_qk: bool = False) -> torch.Tensor:
        """GPT-2's attention. The keywords re-run it with a known mistake, for diagnosis: another score scale, a
        causal mask shifted by mask_shift diagonals, q and k swapped."""
        B, T, C = x.shape
        H = self.config.n_head
        D = C // H
        qkv = x @ w["attn.c_attn.weight"] + w["attn.c_attn.bias"]  # Conv1D: x @ W with W stored (in, out)
        q, k, v = (t.reshape(B, T, H, D).transpose(1, 2) for t in qkv.split(C, dim=-1))
        if swap_qk:
            q, k = k, q
        if scale is None:
            scale = 1.0
            if self.config.scale_attn:
                scale /= math.sqrt(D)
            if self.config.inverse_layer_scale:
                scale /= layer + 1
        future = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1 + mask_shift)
        y = torch.empty_like(q)
        for b in range(B):  # one sequence at a time: the (H, T, T) scores are the largest temporary
            scores = (q[b] @ k[b].transpose(-1, -2)) * scale
            scores = scores.masked_fill(future, float("-inf"))
            scores = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
            y[b] = (scores / scores.sum(dim=-1, keepdim=True)) @ v[b]
        y = y.transpose(1, 2).reshape(B, T, C)
        return y @ w["attn.c_proj.weight"] + w["attn.c_proj.bias"]

    def mlp(self, x: torch.Tensor, w: dict[str, torch.Tensor], activation: str | None = None) -> torch.Tensor:
        act = ACTIVATIONS[activation or self.config.activation]
        return act(x @ w["mlp.c_fc.weight"] + w["mlp.c_fc.bias"]) @ w["mlp.c_proj.weight"] + w["mlp.c_proj.bias"]

    def forward(self, inputs: list[torch.Tensor], observe: Callable[[Stage], None] | None = None,
                progress: Callable[[int, int], None] | None = None) -> list[torch.Tensor]:
        """Float64 logits (B, T, vocab) for each (B, T) int64 id tensor in `inputs`.

        observe(Stage) sees the embeddings, every block's intermediates and the final LayerNorm, for all inputs at
        once; progress(done_blocks, n_layer) is called after each block.
        """
        cfg = self.config
        observe = observe or (lambda stage: None)
        wte = self.files.get("wte.weight")
        wpe = self.files.get("wpe.weight")
        hs = self._embed(inputs, wte, wpe)
        observe(Stage("embeddings", None, {"out": hs}, {"wte": wte, "wpe": wpe}))
        del wpe
        for i in range(cfg.n_layer):
            w = self._block(i)
            vals: dict[str, list[torch.Tensor]] = {"in": hs, "attn": [], "mid": [], "mlp": [], "out": []}
            for h in hs:
                a = self.attention(layer_norm(h, w["ln_1.weight"], w["ln_1.bias"], cfg.eps), w, i)
                mid = h + a
                m = self.mlp(layer_norm(mid, w["ln_2.weight"], w["ln_2.bias"], cfg.eps), w)
                for name, t in (("attn", a), ("mid", mid), ("mlp", m), ("out", mid + m)):
                    vals[name].append(t)
            observe(Stage("block", i, vals, w))
            del w
            hs = vals["out"]
            del vals
            if progress:
                progress(i + 1, cfg.n_layer)
        ln_w, ln_b = self.files.get64("ln_f.weight"), self.files.get64("ln_f.bias")
        finals = [layer_norm(h, ln_w, ln_b, cfg.eps) for h in hs]
        observe(Stage("final", None, {"in": hs, "out": finals}, {"ln_f.weight": ln_w, "ln_f.bias": ln_b}))
        del hs
        head = wte if cfg.tied else self.files.get("lm_head.weight")
        del wte
        return [logits64(f, head) for f in finals]


def logits64(x: torch.Tensor, head: torch.Tensor, rows: int = 8192) -> torch.Tensor:
    """x @ head.T in float64, the head converted a slice of rows at a time: a float64 copy of the whole vocabulary
    (0.6 GB at gpt2-xl) never exists beside the model under test, and the logits are written in place (no second
    copy of them while the slices are joined)."""
    out = x.new_empty(*x.shape[:-1], head.shape[0])
    for s in range(0, head.shape[0], rows):
        torch.matmul(x, head[s:s + rows].to(torch.float64).T, out=out[..., s:s + rows])
    return out
