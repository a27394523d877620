"""adapter_config.json's schema: every field gpt2port reads or that changes what the adapter means, checked before
any value is used (types, finite numbers, ranges), and the per-module settings resolved as peft resolves them.

peft resolves `rank_pattern` and `alpha_pattern` (each on its own) by the first key, in the file's order, for which
`re.match(rf"(.*\\.)?({key})$", module)` matches; `target_modules` as a list by suffix, as a string by
`re.fullmatch`. gpt2port never runs a user's regular expression (one crafted key backtracks for seconds per
character): a key made only of name characters and dots is matched by the same rule in linear time (a dot matching
any one character, as in the expression), and any other key is refused by name. `layers_to_transform` and
`layers_pattern` are honoured as peft honours them for GPT-2's blocks (`transformer.h.N`): a tensor of a layer
peft would not adapt is refused, and a pattern that is not "h" (which finds no GPT-2 layer) too.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from gpt2port.errors import GPT2PortError

_LITERAL = re.compile(r"[A-Za-z0-9_.]+")  # a key of these characters is matched without running it as a pattern
# Fields that change what a LoRA adapter computes beyond B A, each accepted only at the value that means "off".
_OFF = {"use_dora": (False, None), "lora_bias": (False, None), "modules_to_save": (None, []),
        "layer_replication": (None, []), "trainable_token_indices": (None, [], {}), "target_parameters": (None, []),
        "alora_invocation_tokens": (None, []), "use_qalora": (False, None), "megatron_config": (None,)}
_BOOLS = ("fan_in_fan_out", "use_rslora", "use_dora", "inference_mode", "lora_bias", "use_qalora")


@dataclass(frozen=True)
class AdapterConfig:
    """The checked settings of one adapter_config.json (`where` names it in every refusal)."""
    where: str
    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict
    alpha_pattern: dict
    targets: list | str | None  # target_modules: suffixes of module names, or (a string) the whole name; None: any
    exclude: list
    layers: frozenset | None  # layers_to_transform (None: every layer)

    def rank(self, module: str) -> int:
        """The rank peft gives `module` (transformer.h.3.attn.c_attn)."""
        return _lookup(self.rank_pattern, module, self.r)

    def scaling(self, module: str, rank: int) -> float:
        alpha = _lookup(self.alpha_pattern, module, self.alpha)
        return alpha / (math.sqrt(rank) if self.use_rslora else rank)

    def refuse_unadapted(self, module: str, layer: int, tensor: str, weights) -> None:
        """Refuse a tensor of a module peft would not adapt under these settings (it would not load it)."""
        why = None
        if isinstance(self.targets, str) and not (len(self.targets) == len(module) and _suffix(self.targets, module)):
            why = f"target_modules {self.targets!r} (matched against the whole name) does not name it"
        elif isinstance(self.targets, list) and not any(_suffix(t, module, False) for t in self.targets):
            why = f"target_modules {self.targets} do not name it"
        elif any(_suffix(t, module, False) for t in self.exclude):
            why = f"exclude_modules {self.exclude} names it"
        elif self.layers is not None and layer not in self.layers:
            why = f"layers_to_transform {sorted(self.layers)} leaves out layer {layer}"
        if why:
            raise GPT2PortError(f"{weights}: tensor {tensor!r} adapts {module}, but {self.where} says {why} (peft "
                                f"would not load it)")


def check(cfg: dict, where) -> AdapterConfig:
    """The checked settings of `cfg`, read from `where`; one line naming the key at fault."""
    if cfg.get("peft_type") != "LORA":
        raise GPT2PortError(f"{where}: peft_type is {_shown(cfg.get('peft_type'))}; gpt2port merges LORA adapters "
                            f"only")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        if not _LITERAL.fullmatch(targets):
            raise GPT2PortError(f"{where}: target_modules {_shown(targets)} is a regular expression; gpt2port does "
                                f"not run one from a file: list the modules (e.g. [\"c_attn\", \"c_proj\"])")
    elif targets is not None:
        targets = _names(targets, "target_modules", where)
        other = [t for t in targets if t.rsplit(".", 1)[-1] not in ("c_attn", "c_proj", "c_fc")]
        if other:
            raise GPT2PortError(f"{where}: target_modules {other} are not GPT-2's c_attn, c_proj or c_fc (only "
                                f"those can be merged)")
    exclude = cfg.get("exclude_modules")
    if isinstance(exclude, str):
        raise GPT2PortError(f"{where}: exclude_modules {_shown(exclude)} is a regular expression; gpt2port does not "
                            f"run one from a file: list the modules")
    exclude = [] if exclude is None else _names(exclude, "exclude_modules", where)
    for key in _BOOLS:
        if key in cfg and not isinstance(cfg[key], bool) and not (cfg[key] is None and key != "fan_in_fan_out"):
            raise GPT2PortError(f"{where}: {key} is {_shown(cfg[key])}; it must be true or false (a JSON boolean)")
    if cfg.get("fan_in_fan_out") is not True:
        raise GPT2PortError(f"{where}: fan_in_fan_out is {_shown(cfg.get('fan_in_fan_out'))}, but GPT-2's c_attn, "
                            f"c_proj and c_fc are Conv1D, stored (in, out): an adapter of GPT2LMHeadModel says true "
                            f"(peft sets it); this one was made for another layout")
    for key, off in _OFF.items():
        if key in cfg and not any(cfg[key] == v and type(cfg[key]) is type(v) for v in off):
            raise GPT2PortError(f"{where}: {key} is {_shown(cfg[key])}; gpt2port merges plain LoRA (B A on c_attn, "
                                f"c_proj, c_fc) only")
    if cfg.get("bias", "none") != "none":
        raise GPT2PortError(f"{where}: bias {_shown(cfg['bias'])}: trained biases are not supported (bias \"none\" "
                            f"only)")
    r = _rank(cfg.get("r", 8), f"{where}: r")
    alpha = _alpha(cfg.get("lora_alpha", 8), f"{where}: lora_alpha")
    rank_pattern = _patterns(cfg, "rank_pattern", where, _rank)
    alpha_pattern = _patterns(cfg, "alpha_pattern", where, _alpha)
    return AdapterConfig(str(where), r, alpha, bool(cfg.get("use_rslora")), rank_pattern, alpha_pattern, targets,
                         exclude, _layers(cfg, where))


def _shown(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _rank(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 20:
        raise GPT2PortError(f"{what} is {_shown(v)}; a rank is a whole number from 1 (to {1 << 20})")
    return v


def _alpha(v, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= 1e6:
        raise GPT2PortError(f"{what} is {_shown(v)}; alpha is a finite number above 0 (at most 1e6)")
    return float(v)


def _names(v, key: str, where) -> list:
    if not isinstance(v, list) or not all(isinstance(t, str) and t for t in v):
        raise GPT2PortError(f"{where}: {key} is {_shown(v)}; a list of module names is needed")
    bad = next((t for t in v if not _LITERAL.fullmatch(t)), None)
    if bad is not None:
        raise GPT2PortError(f"{where}: {key} entry {_shown(bad)} is not a module name")
    return v


def _patterns(cfg: dict, key: str, where, value) -> dict:
    patterns = {} if cfg.get(key) is None else cfg[key]
    if not isinstance(patterns, dict):
        raise GPT2PortError(f"{where}: {key} is {_shown(patterns)}; an object of module name -> value is needed")
    for k, v in patterns.items():
        if not _LITERAL.fullmatch(k):
            raise GPT2PortError(f"{where}: {key} key {_shown(k)} is not a module name; gpt2port matches module "
                                f"names only (e.g. \"c_attn\" or \"transformer.h.3.attn.c_attn\"), never runs a "
                                f"regular expression from a file")
        value(v, f"{where}: {key}[{_shown(k)}]")
    return {k: (float(v) if value is _alpha else v) for k, v in patterns.items()}


def _layers(cfg: dict, where) -> frozenset | None:
    layers = cfg.get("layers_to_transform")
    if layers is None or layers == []:
        pattern = None
    else:
        items = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
        if not isinstance(items, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 16
                                                  for i in items):
            raise GPT2PortError(f"{where}: layers_to_transform is {_shown(layers)}; a layer number or a list of "
                                f"them is needed")
        pattern = frozenset(items)
    found = cfg.get("layers_pattern")
    if found not in (None, "", [], "h", ["h"]):
        raise GPT2PortError(f"{where}: layers_pattern is {_shown(found)}; GPT-2's blocks are transformer.h.N, so "
                            f"only \"h\" finds them (peft would adapt no layer)")
    return pattern


def _suffix(key: str, module: str, wild: bool = True) -> bool:
    """peft's `(.*\\.)?(key)$` for a key of name characters and dots, in linear time: the module's last len(key)
    characters match the key (with `wild`, a dot in the key matches any one character, as in the expression; without,
    the key is literal, as peft matches a list of target_modules), at its start or after a dot."""
    n = len(key)
    if n > len(module) or (n < len(module) and module[-n - 1] != "."):
        return False
    return all(k == m or (wild and k == ".") for k, m in zip(key, module[-n:]))


def _lookup(patterns: dict, module: str, default):
    return next((v for k, v in patterns.items() if _suffix(k, module)), default)
