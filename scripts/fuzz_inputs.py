"""The fuzzer's generators for eval data and LoRA adapters (scripts/fuzz.py, formats "eval-data" and "adapter").

eval-data: a LAMBADA and a HellaSwag jsonl written from English text; each case damages one line of one of them (a
hostile value at a field, a field removed, a line nested 50k deep, a 5,000-digit label, an ending that the harness's
preprocessing empties, a line of 20 MB, bytes mutated as the other formats' are) and runs `eval` on the tiny model.
adapter: a peft adapter of the tiny model written by gpt2port (adapter_config.json + adapter_model.safetensors);
each case puts a hostile value into one config field (a regular expression as a pattern key, a rank of 0, a string
boolean, NaN), a NaN/Inf/1e20 into one tensor, or mutates the safetensors bytes, and runs `merge` and `export --to
gguf`. Judged as every case is (scripts/fuzz.py) and here: an accepted eval prints no NaN; a refused case leaves its
inputs as they were.
"""

from __future__ import annotations

import json
import random
import shutil
import re
import struct
from pathlib import Path

from scripts.fuzz_mutate import JSON_VALUES, MUTATORS

ENGLISH = ("The river ran past the old mill and under the stone bridge before it reached the town. Children played "
           "on its banks in summer, and in winter the ice was thick enough to walk on. The miller kept a small boat "
           "tied to the post by the door, and every morning he rowed across to buy bread from the baker. ")
# Keys that are regular expressions (the first: ~35 s of backtracking on one GPT-2 module name in Python's re), then
# module names.
REGEX_KEYS = ["(.*)*!", "(a|aa)+$", "(.*a){20}", "h\\.0\\..*", ""]
PATTERN_KEYS = [*REGEX_KEYS, "c_attn", "h.0.attn.c_attn", "transformer.h.1.mlp.c_fc", "x" * 300]
PATTERN_VALUES = [3, 2, 2.5, 4, 0, "x", 1e309, None]  # the last four are no rank or alpha
# Values every one of which must be refused (an adapter taken with it would compute something else, or nothing),
# then values that may be taken.
CONFIG_VALUES = {"r": [0, -1, 2.5, "4", True, 10 ** 30, None], "lora_alpha": [0, -8, "8", 1e309, None, True],
                 "use_rslora": ["no", 1, []], "fan_in_fan_out": ["true", 1, False],
                 "target_modules": [".*c_attn", [3], ["lm_head"]], "layers_to_transform": ["0", [-1], [True]],
                 "layers_pattern": ["layers", 3], "bias": ["all", 3], "peft_type": ["IA3", None],
                 "use_dora": [True, "false"], "exclude_modules": [".*"], "modules_to_save": [["lm_head"]],
                 "lora_bias": [True]}
BENIGN = {"use_rslora": [True, None], "layers_pattern": ["h", ["h"]], "target_modules": [None, ["c_attn", "c_fc"]],
          "layers_to_transform": [None, []], "exclude_modules": [None, []]}
EXPECT = "expect"  # a file in the case: "refused" when the mutation must be refused


def _corpus(rng_seed: int = 0) -> list[str]:
    words = ENGLISH.split()
    rng = random.Random(rng_seed)
    return [" ".join(words[i : i + rng.randint(8, 20)]) for i in range(0, len(words) - 20, 7)]


# --- eval data ------------------------------------------------------------------------------------------------------

class EvalData:
    NAME = "eval-data"

    @staticmethod
    def build(root: Path) -> Path:
        from scripts import hostile_files

        root.mkdir(parents=True)
        hostile_files.build(root / "base", ["gpt2port"])
        data = root / "data"
        data.mkdir()
        lines = _corpus()
        (data / "lambada.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in lines))
        rows = [{"ind": i, "activity_label": "Walking", "ctx_a": s, "ctx_b": "then", "ctx": s + " then",
                 "endings": [lines[(i + k) % len(lines)] for k in range(4)], "label": i % 4}
                for i, s in enumerate(lines)]
        (data / "hellaswag.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return data

    @staticmethod
    def commands(case: Path, seed: Path) -> list[list]:
        ckpt = seed.parent / "base" / "gpt2port"
        task = (case / "task").read_text()
        return [["eval", ckpt, "--task", task, "--data", case / f"{task}.jsonl", "--device", "cpu", "--quiet"]]

    @staticmethod
    def mutate(case: Path, rng: random.Random) -> tuple[str, str, str]:
        task = rng.choice(["lambada", "hellaswag"])
        (case / "task").write_text(task)
        path = case / f"{task}.jsonl"
        lines = path.read_text().splitlines()
        kind = rng.choices(["field", "line", "bytes"], [4, 2, 2])[0]
        if kind == "bytes":
            kinds = [k for k, (applies, _, _) in MUTATORS.items() if applies(path)]
            k = rng.choices(kinds, [MUTATORS[k][2] for k in kinds])[0]
            return path.name, k, MUTATORS[k][1](path, rng)
        at = rng.randrange(len(lines))
        if kind == "line":
            lines[at], what = rng.choice([("[" * 50_000, "nested 50k deep"), ('{"text": "' + "a " * 10_000_000 + '"}',
                                          "a line of 20 MB"), ("", "blank"), ("\x00\xff", "not UTF-8"),
                                          ('{"label": 1' + "0" * 5000 + "}", "a 5,000-digit number")])
        else:
            row = json.loads(lines[at])
            key = rng.choice(list(row) + ["endings.0", "label"])
            value = rng.choice(JSON_VALUES + ['"[title]"', '" "', '"' + "9" * 5000 + '"', '"\\u00b2"', "[]"])
            if key == "endings.0" and "endings" in row:
                row["endings"][0], key = "@@", "endings[0]"
            else:
                row[key] = "@@"
            lines[at], what = json.dumps(row).replace('"@@"', value), f"line {at + 1}: {key} := {value[:20]}"
        path.write_text("\n".join(lines) + "\n")
        return path.name, kind, what

    @staticmethod
    def judge(case: Path, result: dict, before: dict, after: dict) -> str | None:
        if result["rc"] == 0 and re.search(r"\bnan\b", result["stdout"], re.I):
            return "printed a NaN figure"
        if after != before:
            return "the data changed"
        return None


# --- adapters -------------------------------------------------------------------------------------------------------

class Adapter:
    NAME = "adapter"

    @staticmethod
    def build(root: Path) -> Path:
        import torch

        from gpt2port.checkpoint import read_config
        from gpt2port.lora.peft import write_adapter
        from scripts import hostile_files

        root.mkdir(parents=True)
        ckpt = hostile_files.build(root / "base", ["gpt2port"])["gpt2port"]
        c = read_config(ckpt)
        g = torch.Generator().manual_seed(0)
        deltas = {}
        for i in range(c.n_layer):
            for module, n_in, n_out in (("attn.qkv", c.n_embd, 3 * c.n_embd), ("mlp.fc", c.n_embd, c.mlp_width)):
                deltas[f"blocks.{i}.{module}"] = (torch.randn(2, n_in, generator=g) * 0.02,
                                                  torch.randn(n_out, 2, generator=g) * 0.02, 2.0)
        adapter = root / "adapter"
        adapter.mkdir()
        write_adapter(adapter, deltas, "base")
        return adapter

    @staticmethod
    def commands(case: Path, seed: Path) -> list[list]:
        base = seed.parent / "base" / "gpt2port"
        out = case.parent / f"{case.name}-out"  # beside the adapter: an output inside it is refused as such
        return [["merge", base, case, "--out", out], ["export", case, "--to", "gguf", "--out", out]]

    @staticmethod
    def mutate(case: Path, rng: random.Random) -> tuple[str, str, str]:
        kind = rng.choices(["config", "pattern", "tensor", "bytes"], [4, 2, 2, 1])[0]
        config, weights = case / "adapter_config.json", case / "adapter_model.safetensors"
        if kind in ("config", "pattern"):
            cfg = json.loads(config.read_text())
            if kind == "pattern":
                key = rng.choice(["rank_pattern", "alpha_pattern"])
                k, v = rng.choice(PATTERN_KEYS), rng.choice(PATTERN_VALUES)
                cfg[key] = {k: v}
                hostile = k in REGEX_KEYS or v in (0, "x", 1e309, None) or (key == "rank_pattern" and v == 2.5)
            else:
                key = rng.choice(list(CONFIG_VALUES))
                hostile = key not in BENIGN or rng.random() < 0.7
                cfg[key] = rng.choice(CONFIG_VALUES[key] if hostile else BENIGN[key])
            what = f"{key} := {json.dumps(cfg[key])[:60]}"
            config.write_text(json.dumps(cfg))  # 1e309 written as Infinity, as Python's json writes it
            if hostile:
                (case / EXPECT).write_text("refused")
            return config.name, kind, what
        if kind == "tensor":
            data = bytearray(weights.read_bytes())
            (n,) = struct.unpack("<Q", data[:8])
            header = json.loads(data[8 : 8 + n])
            name = rng.choice(sorted(k for k in header if k != "__metadata__"))
            start = 8 + n + header[name]["data_offsets"][0]
            value = rng.choice([float("nan"), float("inf"), 1e20, -1e20])
            data[start : start + 4] = struct.pack("<f", value)
            if value in (1e20, -1e20):  # its partner too, so that the product overflows
                other = name.replace("lora_A", "lora_@").replace("lora_B", "lora_A").replace("lora_@", "lora_B")
                s2 = 8 + n + header[other]["data_offsets"][0]
                data[s2 : s2 + 4] = struct.pack("<f", value)
            weights.write_bytes(bytes(data))
            (case / EXPECT).write_text("refused")
            return weights.name, kind, f"{name}[0] := {value}"
        kinds = [k for k, (applies, _, _) in MUTATORS.items() if applies(weights)]
        k = rng.choices(kinds, [MUTATORS[k][2] for k in kinds])[0]
        return weights.name, k, MUTATORS[k][1](weights, rng)

    @staticmethod
    def judge(case: Path, result: dict, before: dict, after: dict) -> str | None:
        shutil.rmtree(case.parent / f"{case.name}-out", ignore_errors=True)
        if after != before:
            return "the adapter changed"
        if result["rc"] == 0 and (case / EXPECT).is_file():
            return "a hostile adapter was taken (exit 0)"
        return None
