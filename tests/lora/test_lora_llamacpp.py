"""llama.cpp itself (llama-cpp-python's lora_path) runs the adapter GGUF over the base's GGUF and computes what it
computes on the merged model's GGUF. Skipped where llama-cpp-python is not installed (it builds llama.cpp from
source; this project's machines do not have it)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.lora.helpers import lora_model
from tests.support import run_cli

llama_cpp = pytest.importorskip("llama_cpp")


def test_llama_cpp_with_the_adapter_equals_llama_cpp_on_the_merged_model(realistic_base, tmp_path):
    from gpt2port.lora import layer
    from gpt2port.lora.peft import write_adapter

    ckpt, _ = realistic_base
    (tmp_path / "adapter").mkdir()
    write_adapter(tmp_path / "adapter", layer.deltas_of(lora_model(ckpt, split_qkv=True)), str(ckpt))
    for args in (["merge", ckpt, tmp_path / "adapter", "--out", tmp_path / "merged"],
                 ["export", ckpt, "--to", "gguf", "--out", tmp_path / "base"],
                 ["export", tmp_path / "merged", "--to", "gguf", "--out", tmp_path / "merged-gguf"],
                 ["export", tmp_path / "adapter", "--to", "gguf", "--out", tmp_path / "lora"]):
        assert run_cli(*args).exit_code == 0, args
    ids = list(range(100, 140))

    def logits(model, **kw):
        llm = llama_cpp.Llama(str(model), logits_all=True, n_ctx=64, n_threads=2, verbose=False, **kw)
        llm.eval(ids)
        return np.asarray(llm.scores[: len(ids)], dtype=np.float32)

    base = logits(tmp_path / "base" / "model.gguf")
    merged = logits(tmp_path / "merged-gguf" / "model.gguf")
    adapted = logits(tmp_path / "base" / "model.gguf", lora_path=str(tmp_path / "lora" / "adapter.gguf"))
    assert np.abs(merged - base).max() / np.abs(base).max() > 1e-2  # the adapter moves llama.cpp's logits
    assert np.abs(adapted - merged).max() / np.abs(merged).max() <= 1e-3  # llama.cpp's own f32 agreement
