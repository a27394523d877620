"""Every Python example in README.md and docs/*.md runs as it stands.

The convention the docs follow: an example runs in a directory where `checkpoints/gpt2` is a converted checkpoint
(what the README's set-up leaves) and `mygpt.py` the class of docs/mygpt.py; nothing else (no `hf/gpt2`). Here
that directory is a temporary one holding the tiny model under those names, one fresh copy per example. An example that
needs what a test cannot have (the Hub, a GPU) says so on the line above its fence:
`<!-- snippet: skip (needs the Hub) -->`, and is skipped with that reason."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from tests.support import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"<!--\s*snippet:\s*skip\s*\((.+?)\)\s*-->")
# Runtimes an example may show that no gpt2port extra installs (the `test` extra does): without one, skipped.
OPTIONAL = ("onnxruntime_genai",)


def snippets(path: Path, root: Path = ROOT) -> list:
    """(id, code, skip reason or None) for each ```python block of a Markdown file."""
    lines = path.read_text(encoding="utf-8").split("\n")
    found, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            i += 1
            body = []
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            above = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            skip = SKIP.search(above)
            found.append((f"{path.relative_to(root)}:{start + 1}", "\n".join(body), skip and skip.group(1)))
        i += 1
    return found


ALL = [s for p in DOCS for s in snippets(p)]


def test_the_docs_have_examples_and_the_skip_mark_is_read(tmp_path):
    names = {i.split(":")[0] for i, _, _ in ALL}
    assert {"README.md", "docs/verify.md", "docs/generate.md", "docs/your-class.md"} <= names, names
    (tmp_path / "t.md").write_text("x\n<!-- snippet: skip (needs the Hub) -->\n\n```python\n1/0\n```\n")
    assert snippets(tmp_path / "t.md", tmp_path) == [("t.md:4", "1/0", "needs the Hub")]


@pytest.fixture
def docs_cwd(tmp_path, tiny_ckpt, monkeypatch):
    shutil.copytree(tiny_ckpt, tmp_path / "checkpoints" / "gpt2")
    shutil.copy(ROOT / "docs" / "mygpt.py", tmp_path / "mygpt.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mygpt", raising=False)
    return tmp_path


@pytest.mark.parametrize("code, skip", [pytest.param(c, s, id=i) for i, c, s in ALL])
def test_example_runs(code, skip, docs_cwd):
    if skip:
        pytest.skip(skip)
    for name in OPTIONAL:
        if re.search(rf"^(import|from) {name}\b", code, re.M):
            pytest.importorskip(name)
    exec(compile(code, "<example>", "exec"), {"__name__": "__example__"})
    assert not (ROOT / "checkpoints" / "gpt2-tuned").exists()  # it ran here, not in the repository


def test_the_readme_check_example_passes_on_docs_mygpt(docs_cwd):
    """`gpt2port check docs/mygpt.py:make_model gpt2`: the class the docs offer computes GPT-2."""
    r = CliRunner().invoke(_main(), ["check", str(ROOT / "docs" / "mygpt.py") + ":make_model", "checkpoints/gpt2",
                                     "--tokens", "16"])
    assert r.exit_code == 0, r.output
    assert "PASS" in r.output.strip().splitlines()[-1]


def _main():
    from gpt2port.cli import main

    return main


def test_the_readme_stays_a_readme_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 350
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            if not target.startswith("http"):
                assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links to {target}, which is not there"
