"""lm-evaluation-harness itself, run on a local jsonl file through its own task definitions (lambada_openai,
hellaswag), with only the dataset's location changed: the reference the eval tests compare with."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def run_harness(hf_dir: Path, task: str, data: Path, tmp: Path) -> dict:
    """{"metric": value} of the harness's `task` ("lambada_openai" or "hellaswag") over `data`, for the HF model."""
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    folder = {"lambada_openai": "lambada", "hellaswag": "hellaswag"}[task]
    split = {"lambada_openai": "test", "hellaswag": "validation"}[task]
    own = Path(lm_eval.__file__).parent / "tasks" / folder / f"{task}.yaml"
    tasks = tmp / "harness-tasks"
    tasks.mkdir(exist_ok=True)
    name = f"gpt2port_{task}"
    (tasks / f"{name}.yaml").write_text(
        f"include: {own}\ntask: {name}\ntag: []\ndataset_path: json\ndataset_name: null\ntraining_split: null\n"
        f"dataset_kwargs:\n  data_files:\n    {split}: {data}\n")
    lm = HFLM(pretrained=str(hf_dir), batch_size=16, device="cpu", dtype="float32")
    out = simple_evaluate(model=lm, tasks=[name], task_manager=TaskManager(include_path=str(tasks)),
                          bootstrap_iters=0)
    return {k.split(",")[0]: v for k, v in out["results"][name].items() if k.endswith(",none")}
