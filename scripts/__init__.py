"""Benchmarks, random-checkpoint makers and the stand-in Hub, run from the repo root as `python -m scripts.NAME`."""
