#!/usr/bin/env bash
# One command on one CUDA GPU (an H100: under 8 minutes): the CUDA tests (an edited model.py held to generate's
# logits on the CUDA step and graph among them), the decode step (the model's forward) recorded as a CUDA graph,
# and the figures the docs need -- 124M fp32 (graph vs eager vs HF eager), 1.5B bf16 against the bandwidth floor,
# and a fine-tuning step. Every stage must pass; the first that fails stops the script with its name and a non-zero
# exit (a skipped CUDA test counts as a failure: it would mean the GPU was not used).
#
# Usage, from anywhere:  scripts/gpu_check.sh            (PYTHON=... picks the interpreter; default: python)
# Output: the log on stdout, and the figures as JSON in $OUT (or ./gpu_check_out) for the docs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT_DIR=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT_DIR"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-XXXXXX")
trap 'rm -rf "$WORK"' EXIT

stage() { echo; echo "== $1 ($(date -u +%H:%M:%S))"; }
fail() { echo "gpu_check: FAILED at: $1" >&2; exit 1; }

stage "device"
$PY -c 'import sys, torch
if not torch.cuda.is_available():
    sys.exit("error: gpu_check.sh needs a CUDA device; torch.cuda.is_available() is False here")
print(torch.__version__, torch.cuda.get_device_name())' || fail "device"

stage "CUDA tests (the forward recorded as a graph; an edited model.py reaching the CUDA step and graph)"
log="$OUT_DIR/cuda_tests.log"
timeout 240 $PY -m pytest -q -p no:cacheprovider -rs tests/fast/test_graph.py tests/fast/test_edits.py \
    tests/test_generate.py -k "cuda or graph" \
    2>&1 | tee "$log" || fail "CUDA tests"
if grep -Eq "[0-9]+ skipped" "$log"; then fail "CUDA tests (some skipped: see $log)"; fi

stage "doctor"
timeout 60 $PY -m gpt2port doctor || fail "doctor"

stage "124M fp32: CUDA graph vs eager step vs HF eager"
timeout 150 $PY -m scripts.bench.generate_cuda --sizes gpt2 --dtypes fp32 --repeats 2 --no-compile \
    --workdir "$WORK" --json "$OUT_DIR/decode_124m_fp32.json" || fail "124M fp32 decode"

stage "1.5B bf16 against the bandwidth floor"
timeout 200 $PY -m scripts.bench.generate_cuda --sizes gpt2-xl --dtypes bf16 --repeats 2 --no-compile \
    --workdir "$WORK" --json "$OUT_DIR/decode_1.5b_bf16.json" || fail "1.5B bf16 decode"

stage "fine-tuning step (scripts.bench.finetune --device cuda)"
timeout 90 $PY -m scripts.bench.finetune --device cuda --steps 10 --workdir "$WORK/finetune" \
    2>&1 | tee "$OUT_DIR/finetune.log" || fail "scripts.bench.finetune"

echo; echo "gpu_check: all stages passed; figures in $OUT_DIR"
