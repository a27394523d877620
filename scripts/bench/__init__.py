"""Benchmarks: each measures gpt2port against a named baseline side by side in one run (`python -m scripts.bench.NAME
--help`). Their figures, method and history: docs/performance.md."""
