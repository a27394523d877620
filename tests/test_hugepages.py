"""2 MB pages for the int8 weights (gpt2port.hugepages): what is allocated inside huge_pages() lies in huge pages
where the system allows it, nothing changes where it does not or when switched off, and an int8 model loaded that
way holds its matrices in huge pages and computes exactly what one loaded without does.

The kernel reports each mapping's huge pages in /proc/self/smaps; these tests read it. They run where the system
can give 2 MB pages on request (Linux, glibc, transparent huge pages in "madvise" mode) and skip elsewhere. Where
memory lands depends on what the heap already holds (glibc serves a request from the smallest free block that fits,
which may be one left by an earlier test), so the placement checks run in a fresh interpreter, as a user's program
loading a model starts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from gpt2port import GPT, hugepages

MB = 1 << 20

needs_madvise_thp = pytest.mark.skipif(
    not hugepages._supported() or "hugetlb" in os.environ.get("GLIBC_TUNABLES", ""),
    reason="needs Linux, glibc and transparent huge pages in madvise mode (and glibc not already asked for them)")


def mappings() -> list[tuple[int, int, str]]:
    """(start, end, smaps entry) of every mapping of this process."""
    out = []
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read()):
        start, end = (int(x, 16) for x in block.split(None, 1)[0].split("-"))
        out.append((start, end, block))
    return out


def huge_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of the mapping holding `address`."""
    block = next(b for start, end, b in mappings() if start <= address < end)
    return int(re.search(r"AnonHugePages:\s+(\d+)", block).group(1))


def marked_bytes() -> int:
    """Bytes of the mappings marked with madvise(MADV_HUGEPAGE) (flag "hg" in smaps)."""
    return sum(end - start for start, end, b in mappings() if " hg" in re.search(r"VmFlags:(.*)", b).group(1))


def in_fresh_python(code: str) -> dict:
    """Run `code` (which prints one JSON line last) in a new interpreter from the repository root; its result."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def filled(nbytes: int) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(1)  # pages are backed when first touched
    return t


@needs_madvise_thp
def test_allocations_inside_lie_in_huge_pages():
    got = in_fresh_python("""
import json
from gpt2port import hugepages
from tests.test_hugepages import MB, filled, huge_kib_at
with hugepages.huge_pages(64 * MB) as marked:
    t = filled(16 * MB)
# The region starts up to 2 MB before its first 2 MB boundary: look 8 MB into the tensor.
print(json.dumps({"marked": marked, "huge_kib": huge_kib_at(t.data_ptr() + 8 * MB)}))
""")
    assert got["marked"]
    assert got["huge_kib"] >= 4 * 1024


@needs_madvise_thp
def test_switched_off_nothing_is_marked(monkeypatch):
    monkeypatch.setattr(hugepages, "ENABLED", False)
    before = marked_bytes()
    with hugepages.huge_pages(64 * MB) as marked:
        filled(16 * MB)
    assert not marked
    assert marked_bytes() == before


def test_other_threads_are_left_alone():
    """glibc gives each thread its own arena; the heap trick is for the main one, so another thread gets nothing."""
    seen = []

    def run():
        with hugepages.huge_pages(64 * MB) as marked:
            seen.append(marked)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert seen == [False]


@needs_madvise_thp
def test_int8_model_matrices_in_huge_pages(gpt2_ckpt):
    got = in_fresh_python(f"""
import json
from gpt2port import GPT
from tests.test_hugepages import MB, huge_kib_at
model = GPT.from_pretrained({str(gpt2_ckpt)!r}, dtype="int8")
# The head (50257 x 768 int8, 37 MB) and a block's matrix; fbgemm packs each right after it.
print(json.dumps({{"head": huge_kib_at(model.lm_head.weight.data_ptr() + 16 * MB),
                  "fc": huge_kib_at(model.blocks[5].mlp.fc.weight.data_ptr())}}))
""")
    assert got["head"] >= 16 * 1024
    assert got["fc"] > 0


def test_int8_model_in_huge_pages_computes_the_same(gpt2_ckpt, monkeypatch):
    model = GPT.from_pretrained(gpt2_ckpt, dtype="int8")
    monkeypatch.setattr(hugepages, "ENABLED", False)
    plain = GPT.from_pretrained(gpt2_ckpt, dtype="int8")
    ids = torch.tensor([[464, 3290, 318, 257]])
    with torch.inference_mode():
        assert torch.equal(model(ids), plain(ids))
        assert torch.equal(model(ids[:, :1]), plain(ids[:, :1]))  # one row: fbgemm's packed weights
