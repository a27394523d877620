"""The HF phase: transformers' GPT2LMHeadModel in ours' dtype, the implementation users know and a cross-check of
the float64 reference itself. Optional: without transformers (or with files it cannot load) verify still stands on
the float64 reference, and the report says why HF did not join."""

from __future__ import annotations

import gc
import inspect
from pathlib import Path

import torch

from gpt2port.dtypes import DTYPE_LABELS

from gpt2port.verification.metrics import compare_logits, loss
from gpt2port.formats import WEIGHT_FILES
from gpt2port.verification.report import VerifyReport

HF_WEIGHT_NAMES = set(WEIGHT_FILES)  # the weights file names transformers loads


def _load_hf(ref_path: Path, dt: torch.dtype, report: VerifyReport):
    try:
        import transformers
    except ImportError:
        report.reference["hf_note"] = "transformers is not installed (pip install 'gpt2port[reference]')"
        return None
    from gpt2port.verification.reference_canonical import is_gpt2port_checkpoint

    if is_gpt2port_checkpoint(ref_path):
        report.reference["hf_note"] = (f"{ref_path} is a gpt2port checkpoint, which transformers does not read "
                                       f"(the float64 reference reads its weights)")
        return None
    if ref_path.is_file() and ref_path.name not in HF_WEIGHT_NAMES:
        report.reference["hf_note"] = f"{ref_path.name} is not a file name transformers loads"
        return None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    directory = ref_path if ref_path.is_dir() else ref_path.parent
    try:
        model = transformers.GPT2LMHeadModel.from_pretrained(directory, local_files_only=True, **{dtype_kw: dt})
    except Exception as e:  # noqa: BLE001 - the float64 reference still stands; say why HF could not join
        report.reference["hf_note"] = f"transformers could not load {directory}: {str(e).splitlines()[0][:200]}"
        return None
    report.reference.update(hf=True, hf_version=transformers.__version__, hf_dtype=DTYPE_LABELS[dt])
    return model.eval()


@torch.no_grad()
def hf_phase(ref_path, dt, inputs, ref_logits, ours_logits, tol, report, say) -> dict | None:
    """HF's logits, loss and own greedy continuation on every input, compared with the reference and with ours."""
    say("HF transformers: loading")
    hf = _load_hf(ref_path, dt, report)
    if hf is None:
        report.notes.append(f"HF reference skipped: {report.reference['hf_note']}")
        return None
    compare: dict = {}
    out = {"greedy": {}, "loss": {}, "compare": compare}
    for k, inp in enumerate(inputs):
        say(f"HF transformers: forward {k + 1}/{len(inputs)}")
        logits = hf(inp.ids).logits
        compare[inp.name] = {"hf_vs_f64": compare_logits(logits, ref_logits[k], tol.logits_rel),
                             "ours_vs_hf": compare_logits(ours_logits[k], logits, tol.logits_rel * tol.vs_hf_factor)}
        if inp.text_len >= 2:
            out["loss"][inp.name] = loss(logits, inp.ids, inp.text_len)
        if inp.greedy is not None:
            out["greedy"][inp.name] = _hf_greedy(hf, inp.ids[:, : inp.prompt_len], inp.greedy.shape[1])
        del logits
    del hf
    gc.collect()
    return out


def _hf_greedy(hf, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding through HF's own KV cache, free of any generation_config settings. The cache goes back in
    under the name this transformers takes (`cache` since 5.x, `past_key_values` before, which 5.x warns about)."""
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    out = hf(prompt, use_cache=True)
    chosen = [out.logits[:, -1].argmax(-1)]
    while len(chosen) < n:
        out = hf(chosen[-1][:, None], use_cache=True, **{name: out[name]})
        chosen.append(out.logits[:, -1].argmax(-1))
    return torch.stack(chosen, dim=1)
