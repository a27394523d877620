"""The quick tier (`pytest -m quick`, tests/conftest.py QUICK) stays what docs/testing.md says it is: every entry
names a test that exists, every command of the CLI is run by one of its tests, and the project's licence is there."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from gpt2port.cli import main
from tests.conftest import QUICK

ROOT = Path(__file__).resolve().parents[1]


def _quick_functions() -> dict[str, str]:
    """name -> source of each test function the QUICK entries name (a whole file: all of its tests)."""
    found = {}
    for entry in QUICK:
        path, _, name = entry.partition("::")
        tree = ast.parse((ROOT / path).read_text())
        source = (ROOT / path).read_text()
        tests = {n.name: ast.get_source_segment(source, n) for n in tree.body if isinstance(n, ast.FunctionDef)}
        name = name.split("[")[0]
        assert not name or name in tests, f"{entry}: no such test (renamed? the quick tier lost it)"
        found.update({k: v for k, v in tests.items() if not name or k == name})
    return found


def test_every_command_is_run_by_the_quick_tier():
    sources = "\n".join(_quick_functions().values())
    # what a quick test types: run_cli("finetune", ...), main(["doctor"]), a helper named after the command
    missing = [c for c in main.commands if not any(f in sources for f in (f'"{c}"', f"'{c}'", f"{c}("))]
    assert not missing, f"commands no quick test runs: {missing}"


def test_the_licence_is_the_one_pyproject_declares():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    text = (ROOT / "LICENSE").read_text()
    assert declared == "MIT" and text.startswith("MIT License") and "WITHOUT WARRANTY OF ANY KIND" in text
