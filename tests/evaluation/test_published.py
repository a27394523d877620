"""`--data NAME`: a published dataset fetched from the Hub (the stand-in Hub on 127.0.0.1, scripts/fake_hub.py, over
real HTTP) into the Hugging Face cache, checked against the hash the Hub announced, and read from the cache offline;
scored exactly as the same file passed by path. Each run is a fresh `python -m gpt2port` process: huggingface_hub
reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE at import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

from gpt2port.evaluation.published import SOURCES
from gpt2port.evaluation.run import run_eval
from scripts import eval_data, fake_hub
from tests.evaluation.conftest import english
from tests.support import ROOT, assert_one_line_error

LAMBADA, WIKITEXT = SOURCES["lambada"], SOURCES["wikitext-2"]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """(hub, local copies): the stand-in Hub serving LAMBADA's and WikiText-2's files in their published layouts
    (the jsonl; the zip holding wiki.test.raw), made of the license text the OS ships."""
    root = tmp_path_factory.mktemp("published-hub")
    lambada = root / "datasets" / LAMBADA.repo / LAMBADA.revision / LAMBADA.file  # a commit, as the source pins
    lambada.parent.mkdir(parents=True)
    eval_data.write_lambada(lambada, eval_data.sentences(english())[:40])
    # WikiText's raw layout: each line of text opened by a space, blank lines " "; Hugging Face's loader made a row
    # of each line (newline kept), an empty one of each blank, which the HF guide joins with blank lines
    lines = [f" {line} \n" if line.strip() else " \n" for line in english()[:5000].splitlines()]
    raw = root / "wiki.test.raw"
    raw.write_bytes("".join(lines).encode("utf-8"))
    joined = root / "guide.txt"
    joined.write_bytes("\n\n".join(line if line != " \n" else "" for line in lines).encode("utf-8"))
    archive = root / "datasets" / WIKITEXT.repo / WIKITEXT.revision / WIKITEXT.file
    archive.parent.mkdir(parents=True)
    with zipfile.ZipFile(archive, "w") as z:
        z.write(raw, WIKITEXT.member)
    with fake_hub.FakeHub(root) as hub:
        yield hub, {"lambada": lambada, "wikitext-2": joined, "wikitext-2-raw": raw}


def _eval(hub, home, *args, offline: bool = False):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home / "hf"), HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1",
               OMP_NUM_THREADS="1", **({"HF_HUB_OFFLINE": "1"} if offline else {}))
    return subprocess.run([sys.executable, "-m", "gpt2port", "eval", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name, task", [("lambada", "lambada"), ("wikitext-2", "perplexity"),
                                        ("wikitext-2-raw", "perplexity")])
def test_a_published_name_is_fetched_checked_cached_and_scored_as_its_file(realistic, published, tmp_path, name,
                                                                           task, one_thread):
    hub, local = published
    hub.reset()
    _, ckpt = realistic
    fetched = _eval(hub, tmp_path, ckpt, "--task", task, "--data", name, "--json", "-q")
    assert fetched.returncode == 0, fetched.stderr
    got = json.loads(fetched.stdout)
    source = SOURCES[name]
    assert hub.file_gets() == [source.file]
    assert got["dataset"] == name and got["data"].startswith(f"{source.repo}@") and len(got["data_sha256"]) == 64
    expected = run_eval(str(ckpt), task, str(local[name]))
    figures = ["examples", "accuracy", "perplexity"] if task == "lambada" else ["tokens", "perplexity",
                                                                                  "bits_per_byte"]
    assert {k: got[k] for k in figures} == {k: expected[k] for k in figures}
    hub.reset()
    again = _eval(hub, tmp_path, ckpt, "--task", task, "--data", name, "--json", "-q", offline=True)
    assert again.returncode == 0, again.stderr
    assert hub.entries() == []  # from the cache: not one request
    assert json.loads(again.stdout)["perplexity"] == got["perplexity"]


def test_offline_and_not_cached_says_to_pass_a_file(realistic, published, tmp_path):
    hub, _ = published
    r = _eval(hub, tmp_path, realistic[1], "--task", "lambada", "--data", "lambada", offline=True)
    line = assert_one_line_error(r.returncode, r.stderr, r.stdout, names=["--data lambada", LAMBADA.repo])
    assert "HF_HUB_OFFLINE=1" in line and "--data FILE" in line


def test_a_hub_out_of_reach_is_one_line_at_once(realistic, tmp_path):
    """Not offline mode, but nothing listening: huggingface_hub's download would retry five times over 23 s of
    sleeps, two lines a try; gpt2port asks once."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there

    class Nowhere:
        url = f"http://127.0.0.1:{port}"

    t0 = time.perf_counter()
    r = _eval(Nowhere, tmp_path, realistic[1], "--task", "lambada", "--data", "lambada")
    line = assert_one_line_error(r.returncode, r.stderr, r.stdout, names=["--data lambada", "cannot be reached"])
    assert "--data FILE" in line and time.perf_counter() - t0 < 20


def test_a_corrupted_copy_is_refused_and_removed(realistic, published, tmp_path):
    hub, _ = published
    hub.reset()
    hub.set_faults({"corrupt": {LAMBADA.file: 1}})
    r = _eval(hub, tmp_path, realistic[1], "--task", "lambada", "--data", "lambada", "--json", "-q")
    line = assert_one_line_error(r.returncode, r.stderr, r.stdout, names=["--data lambada", "integrity check"])
    assert "removed from the cache" in line
    assert not [p for p in (tmp_path / "hf").rglob("*") if p.is_file() and "lambada" in str(p) and "blobs" in str(p)]
    r = _eval(hub, tmp_path, realistic[1], "--task", "lambada", "--data", "lambada", "--json", "-q")
    assert r.returncode == 0, r.stderr


def test_the_guide_text_is_the_loader_rows_joined():
    """Rows as Hugging Face's wikitext loader made them (a line as text mode reads it, \\r\\n too, its newline kept;
    a blank or all-space line an empty row), joined by a blank line; bytes that are not UTF-8 refused naming them."""
    from gpt2port.errors import GPT2PortError
    from gpt2port.evaluation.published import rows_joined

    raw = " = Title = \r\n \n Text one .\n\t\n Text two ."
    rows = [" = Title = \n", "", " Text one .\n", "", " Text two ."]
    assert rows_joined(raw.encode(), "x") == "\n\n".join(rows).encode()
    with pytest.raises(GPT2PortError, match="^--data wikitext-2: member: not UTF-8 text$"):
        rows_joined(b" ok\n\xff\n", "--data wikitext-2: member")
