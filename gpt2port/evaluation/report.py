"""What `gpt2port eval` prints: a short table, the JSON, or a model card's model-index block."""

from __future__ import annotations

import json

# Per task: the figures the table shows, in order (the JSON has them all).
SHOWN = {
    "perplexity": ["tokens", "nll", "perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte",
                   "base_perplexity", "perplexity_difference", "kld", "kld_max", "top1_agreement"],
    "lambada": ["examples", "accuracy", "perplexity"],
    "hellaswag": ["examples", "acc", "acc_norm"],
}
# What a Hub model card calls each figure (model-index metrics[].type).
CARD_TYPES = {"perplexity": "perplexity", "accuracy": "accuracy", "acc": "accuracy", "acc_norm": "acc_norm",
              "word_perplexity": "perplexity", "bits_per_byte": "bits_per_byte", "kld": "kl_divergence",
              "top1_agreement": "accuracy"}


def table(result: dict) -> str:
    head = f"{result['task']}: {result['model']} ({result['dtype']}, {result['device']}) on {result['data']}"
    settings = [f"{k} {result[k]}" for k in ("protocol", "stride", "against") if result.get(k) is not None]
    lines = [head + (f" ({', '.join(settings)})" if settings else "")]
    keys = [k for k in SHOWN[result["task"]] if k in result]
    width = max(len(k) for k in keys)
    lines += [f"  {k:<{width}}  {_number(result[k])}" for k in keys]
    lines.append(f"  {'seconds':<{width}}  {result['seconds']:.1f}")
    return "\n".join(lines)


def _number(value) -> str:
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.4f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"


def as_json(result: dict) -> str:
    return json.dumps(result, indent=2, allow_nan=False)


def model_card(result: dict) -> str:
    """A model-index block (YAML, the front matter of a Hub model card) holding this result."""
    what = {"perplexity": ("text-generation", "Text Generation"),
            "lambada": ("text-generation", "Text Generation"),
            "hellaswag": ("text-generation", "Text Generation")}[result["task"]]
    setting = result.get("protocol") or (f"stride {result['stride']}" if "stride" in result else "")
    lines = ["model-index:", f"- name: {_yaml(result['model'])}", "  results:", "  - task:",
             f"      type: {what[0]}", f"      name: {what[1]}", "    dataset:",
             f"      name: {_yaml(result['dataset'])}", f"      type: {_yaml(result['dataset'])}", "    metrics:"]
    for key in SHOWN[result["task"]]:
        if key in CARD_TYPES and key in result:
            name = f"{key} ({setting})" if setting else key
            lines += [f"    - type: {CARD_TYPES[key]}", f"      value: {round(result[key], 4)}",
                      f"      name: {_yaml(name)}"]
    return "\n".join(lines)


def _yaml(text: str) -> str:
    return json.dumps(str(text))  # a JSON string is a YAML string, quoted and escaped
