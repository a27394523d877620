#!/usr/bin/env bash
# The main job, end to end, with no network: install, serve random-weight GPT-2 repos in the real Hub layout on
# 127.0.0.1, then download -> convert -> info -> verify -> generate through the real huggingface_hub client.
#   bash scripts/demo_offline.sh [SIZE]     SIZE: gpt2 (default), gpt2-medium, gpt2-large, gpt2-xl
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root: the helpers run as `python -m scripts.NAME` from here
SIZE="${1:-gpt2}"
WORK="${DEMO_DIR:-/tmp/gpt2port-demo}"
PORT="${DEMO_PORT:-8765}"

if [ ! -x .venv/bin/gpt2port ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q torch==2.13.0          # the CPU build; a bare `torch` pulls CUDA
  .venv/bin/python -m pip install -q -e '.[test]'           # transformers: verify's reference and the fixtures
fi
PY=.venv/bin/python
mkdir -p "$WORK"
[ -d "$WORK/hub/openai-community/$SIZE" ] || $PY -m scripts.fill_fake_hub "$WORK/hub" --sizes "$SIZE" --also-tf-files

$PY -m scripts.fake_hub --root "$WORK/hub" --port "$PORT" > "$WORK/fake_hub.log" 2>&1 &
HUB_PID=$!
trap 'kill $HUB_PID 2>/dev/null || true' EXIT
for _ in $(seq 50); do (echo > /dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.2; done

export HF_ENDPOINT="http://127.0.0.1:$PORT" HF_HUB_DISABLE_XET=1 HF_HOME="$WORK/hf-home"
export GPT2PORT_CHECKPOINTS="$WORK/checkpoints"
set -x
.venv/bin/gpt2port download "$SIZE" --force
.venv/bin/gpt2port info "$SIZE"
.venv/bin/gpt2port verify "$SIZE" --tokens 128
.venv/bin/gpt2port generate "$SIZE" "The dog" --max-new-tokens 20 --seed 0
HF_HUB_OFFLINE=1 .venv/bin/gpt2port download "$SIZE" --out "$WORK/checkpoints/$SIZE-from-cache" --force
