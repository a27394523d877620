"""What was done to a model before verify sees it, as plain data: the choices load_into made for a user's class
(biases dropped, positions cropped, an exact GELU noted) and a checkpoint's own record (fine-tuned from a parent).

Each event is a dict with "event" and "line" (one sentence for a person). A Stages adapter carries its model's
events as `history`; diagnosis (diagnose.py) consults them before the list of known mistakes, and confirms by
measurement what can be measured: a stage re-run in the reference with the dropped biases at zero, or with the
exact GELU, must then match. Nothing here imports the code that records the events."""

from __future__ import annotations

DROPPED_BIASES = "dropped_biases"
CROPPED_POSITIONS = "cropped_positions"
ERF_GELU = "erf_gelu"
FINETUNED = "finetuned"


def dropped_biases(canonical: list[str]) -> dict:
    """canonical: the bias tensors (gpt2port's canonical names, every layer) the class has no place for."""
    return {"event": DROPPED_BIASES, "canonical": sorted(canonical),
            "line": "the biases were dropped at load (drop_biases=True): this difference is their measured cost, "
                    "not a bug"}


def cropped_positions(rows: int, of: int) -> dict:
    return {"event": CROPPED_POSITIONS, "rows": rows, "of": of,
            "line": f"the position table was cropped at load to its first {rows} of {of} rows (crop_positions=True): "
                    f"verified on inputs of at most {rows} tokens"}


def erf_gelu(where: str) -> dict:
    return {"event": ERF_GELU, "where": where,
            "line": f"{where} computes the exact (erf) GELU, noted at load; GPT-2's is the tanh approximation: this "
                    f"difference is that GELU's, not a bug"}


def finetuned(parent: str, record: dict) -> dict:
    steps = (record.get("settings") or {}).get("steps")
    said = f" ({steps} steps)" if steps else ""
    return {"event": FINETUNED, "parent": parent,
            "line": f"these weights were fine-tuned{said} from {parent}: against that source they differ by the "
                    f"fine-tuning, not a bug"}


def from_manifest(manifest: dict) -> list[dict]:
    """A checkpoint's recorded history: each fine-tuning run its manifest records (the latest last)."""
    return [finetuned(str(s.get("from", "its parent")), s["finetune"]) for s in manifest.get("saves", [])
            if isinstance(s, dict) and isinstance(s.get("finetune"), dict)]


def lines(history) -> list[str]:
    return [h["line"] for h in history or ()]
