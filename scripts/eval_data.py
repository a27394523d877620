"""Evaluation files in LAMBADA's and HellaSwag's published layouts, made of real English text that ships with the
operating system or the Python interpreter (a license), for the eval tests and benchmark: never text written for
them. And lm-evaluation-harness run on such a file through its own task definitions."""

from __future__ import annotations

import json
import os
import re
import sysconfig
from pathlib import Path

LICENSES = (Path("/usr/share/common-licenses/GPL-3"), Path(sysconfig.get_path("stdlib")) / "LICENSE.txt")


def english() -> str | None:
    """The GNU GPL v3 as Debian ships it, or the license text every Python installation ships (None: neither)."""
    for path in LICENSES:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    return None


def sentences(text: str, min_words: int = 6) -> list[str]:
    """The text's sentences, whitespace collapsed."""
    flat = " ".join(text.split())
    return [s.strip() for s in re.split(r"(?<=[.;:])\s+", flat) if len(s.split()) >= min_words]


def write_lambada(path: Path, found: list[str]) -> Path:
    """LAMBADA's layout: one {"text": ...} per line, the last word the one to predict."""
    path.write_text("".join(json.dumps({"text": s.rstrip(".;:")}) + "\n" for s in found), encoding="utf-8")
    return path


def write_hellaswag(path: Path, text: str, n: int) -> Path:
    """HellaSwag's layout from a text's sentences: a sentence's start is the context, its own end and the ends of
    three other sentences are the endings; some contexts carry WikiHow's bracketed markers, as the real file's do,
    for the harness's preprocess to remove."""
    found = [s.split() for s in sentences(text, 10) if len(s.split()) <= 40]
    rows = []
    for k in range(min(n, len(found) // 4)):
        group = found[4 * k : 4 * k + 4]
        cut = [len(w) // 2 for w in group]
        ends = [" ".join(w[c:]) for w, c in zip(group, cut)]
        label = k % 4
        endings = ends[1 : label + 1] + [ends[0]] + ends[label + 1 :]
        words = group[0][: cut[0]]
        ctx_a, ctx_b = " ".join(words[:-3]), " ".join(words[-3:]).lower()
        if k % 3 == 0:
            ctx_a = ctx_a + " [title]"
        rows.append({"ind": k, "activity_label": " ".join(words[:2]), "ctx_a": ctx_a, "ctx_b": ctx_b,
                     "ctx": ctx_a + " " + ctx_b, "endings": endings, "label": label, "split": "val"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def run_harness(hf_dir: Path, task: str, data: Path, tmp: Path, batch_size: int = 16) -> dict:
    """{"metric": value} of lm-evaluation-harness's `task` ("lambada_openai" or "hellaswag"), its own task file with
    only the dataset's location changed to `data`, for the Hugging Face model in `hf_dir`, on the CPU in fp32."""
    import lm_eval
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder, split = {"lambada_openai": ("lambada", "test"), "hellaswag": ("hellaswag", "validation")}[task]
    own = Path(lm_eval.__file__).parent / "tasks" / folder / f"{task}.yaml"
    tasks = tmp / "harness-tasks"
    tasks.mkdir(exist_ok=True)
    name = f"gpt2port_{task}"
    (tasks / f"{name}.yaml").write_text(
        f"include: {own}\ntask: {name}\ntag: []\ndataset_path: json\ndataset_name: null\ntraining_split: null\n"
        f"dataset_kwargs:\n  data_files:\n    {split}: {data}\n")
    lm = HFLM(pretrained=str(hf_dir), batch_size=batch_size, device="cpu", dtype="float32")
    out = simple_evaluate(model=lm, tasks=[name], task_manager=TaskManager(include_path=str(tasks)),
                          bootstrap_iters=0)
    return {k.split(",")[0]: v for k, v in out["results"][name].items() if k.endswith(",none")}
