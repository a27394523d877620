"""Tools run from the repository root as `python -m scripts.NAME`: random-checkpoint makers (hf_fixtures,
tf_fixtures), the stand-in Hub (fake_hub, fill_fake_hub) and the offline demo, the fuzzer and the soak, the checks
against llm.c and llama.cpp, the GPU check; benchmarks in scripts/bench/."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root: children run as `python -m scripts.NAME` from here
