"""Every file a command reads passes one gate (gpt2port/inputs.py): a walk of the package's syntax fails when a module
opens a file, reads one whole or parses JSON any other way; and the gate itself, tried with what must not be read."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpt2port
from gpt2port import inputs
from gpt2port.errors import GPT2PortError

PACKAGE = Path(gpt2port.__file__).parent

# (module, what it calls) -> why it may: each a file that is not a user's input, or bytes the gate already read.
ALLOWED = {
    ("inputs.py", "os.open"): "the gate itself",
    ("jsonio.py", "json.loads"): "the one JSON parser, given bytes the gate read",
    ("quant.py", "open"): "/proc/self/maps, the process's own map (not a user's file)",
    ("quant.py", "read_text"): "/proc/cpuinfo, the machine's (not a user's file)",
    ("fast/native.py", "read_text"): "/proc/cpuinfo, the machine's (not a user's file)",
    ("fast/native.py", "read_bytes"): "the package's own C sources, hashed to name the built library",
    ("formats/gguf.py", "read_bytes"): "the header the gguf package has just written into the output being built",
    ("ownership.py", "os.open"): "a gpt2port mark inside an output, judged by lstat first and opened O_NOFOLLOW",
    ("ownership.py", "json.loads"): "the head of such a mark, read bounded by ownership.py",
    ("training/state.py", "torch.load"): "bytes DCP read from a saved state that training/saved.py checked file by "
                                         "file through the gate",
}
_READ_MODES = set("r")
_WRITE_MODES = set("wax+")
_LIBRARY = {"np.load", "np.fromfile", "np.memmap", "numpy.load", "numpy.fromfile", "numpy.memmap", "torch.load",
            "safe_open", "load_file", "safetensors.torch.load_file", "zipfile.ZipFile", "tarfile.open", "gzip.open",
            "pickle.load", "json.load", "shutil.copyfile", "shutil.copy", "shutil.copy2"}
_WRITING_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_DIRECTORY"}


def _dotted(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _through_gate(node, gated: set[str]) -> bool:
    """A path argument that the gate handed over: inputs.checked(...), an open file from inputs, bytes in memory."""
    if isinstance(node, ast.Call):
        f = _dotted(node.func)
        if f in ("str", "os.fspath") and node.args:
            return _through_gate(node.args[0], gated)
        return f.startswith("inputs.") or f in ("checked", "io.BytesIO", "BytesIO")
    return isinstance(node, ast.Name) and node.id in gated


def _mode(call: ast.Call):
    mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
    if mode is None:
        return "r"
    return mode.value if isinstance(mode, ast.Constant) and isinstance(mode.value, str) else None


def around_the_gate(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, call) of every read in `tree` that does not go through gpt2port/inputs.py."""
    gated = set()  # names bound to what the gate opened: `with inputs.open_binary(p) as f`, `fd = inputs.open_fd(p)`
    for node in ast.walk(tree):
        if isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name) and \
                _through_gate(node.context_expr, set()):
            gated.add(node.optional_vars.id)
        elif isinstance(node, ast.Assign) and _through_gate(node.value, set()):
            gated |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    hits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        first = node.args[0] if node.args else None
        if name in ("open", "io.open"):
            mode = _mode(node)
            if mode is None or not set(mode) & _WRITE_MODES:
                hits.append((node.lineno, "open"))
        elif name == "os.open":
            flags = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "value", None)
                     for n in ast.walk(node.args[1])} if len(node.args) > 1 else set()
            if not flags & _WRITING_FLAGS:
                hits.append((node.lineno, "os.open"))
        elif name in ("json.loads",):
            hits.append((node.lineno, name))
        elif name in _LIBRARY or name.rsplit(".", 1)[-1] in ("safe_open", "load_file"):
            if first is None or not _through_gate(first, gated):
                hits.append((node.lineno, name))
        elif isinstance(node.func, ast.Attribute) and node.func.attr in ("read_bytes", "read_text") and \
                not node.args and _dotted(node.func.value) != "inputs":
            hits.append((node.lineno, node.func.attr))
        elif isinstance(node.func, ast.Attribute) and node.func.attr == "open" and node.args and \
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str) and \
                not set(node.args[0].value) & _WRITE_MODES:
            hits.append((node.lineno, "Path.open"))
    return hits


def test_every_module_reads_files_through_the_gate():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for line, call in around_the_gate(ast.parse(path.read_text())):
            if (rel, call) not in ALLOWED:
                found.append(f"gpt2port/{rel}:{line}: {call}")
    assert not found, "reads around gpt2port/inputs.py:\n" + "\n".join(found)


def test_every_allowance_is_still_needed():
    used = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        used |= {(rel, call) for _, call in around_the_gate(ast.parse(path.read_text()))}
    assert set(ALLOWED) <= used, set(ALLOWED) - used


def test_the_walk_sees_a_command_written_around_the_gate(tmp_path):
    """A throwaway command that reads its --data as eval once did: every read is found; the same command written
    through the gate passes."""
    around = tmp_path / "around.py"
    around.write_text(
        "import json, numpy as np, torch\nfrom pathlib import Path\n"
        "def run(data, weights):\n"
        "    rows = [json.loads(line) for line in Path(data).read_bytes().splitlines()]\n"
        "    with open(data) as f:\n        text = f.read()\n"
        "    with open(data, 'rb') as f:\n        raw = f.read()\n"
        "    ids = np.memmap(weights, dtype='uint16', mode='r')\n"
        "    sd = torch.load(weights, weights_only=True)\n"
        "    head = Path(data).open('rb').read(8)\n"
        "    with open(weights + '.out', 'wb') as out:\n        out.write(raw)\n")  # a write is not a read
    hits = around_the_gate(ast.parse(around.read_text()))
    assert sorted(hits) == [(4, "json.loads"), (4, "read_bytes"), (5, "open"), (7, "open"), (9, "np.memmap"),
                            (10, "torch.load"), (11, "Path.open")], hits
    through = ("import io, numpy as np, torch\nfrom gpt2port import inputs, jsonio\n"
               "def run(data, weights):\n"
               "    rows = inputs.read_jsonl(data, inputs.LIMITS['eval data'])\n"
               "    with inputs.open_binary(data) as f:\n        head = f.read(8)\n"
               "    ids = np.memmap(inputs.checked(weights), dtype='uint16', mode='r')\n"
               "    sd = torch.load(io.BytesIO(inputs.read_bytes(weights, 1 << 20)), weights_only=True)\n"
               "    value = jsonio.loads(head, data)\n")
    assert around_the_gate(ast.parse(through)) == []


# --- the gate itself ---------------------------------------------------------------------------------------------

def _refused(fn, *words):
    with pytest.raises(GPT2PortError) as e:
        fn()
    line = str(e.value)
    assert "\n" not in line and all(w in line for w in words), line
    return line


def test_a_fifo_is_refused_before_it_is_opened(tmp_path):
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    link = tmp_path / "link.json"
    link.symlink_to(fifo)
    t0 = time.monotonic()
    _refused(lambda: inputs.read_jsonl(fifo, 1 << 20), str(fifo), "FIFO")
    _refused(lambda: inputs.read_json(link), str(link), "FIFO")
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("path, words", [("/dev/zero", ["character device"]), ("/dev/null", ["character device"]),
                                         ("/proc/self/status", ["/proc"]), ("/proc/self/environ", ["/proc"])])
def test_devices_and_proc_are_refused(path, words):
    if not Path(path).exists():
        pytest.skip(f"{path} is not on this system")
    _refused(lambda: inputs.read_bytes(path, 1 << 20), path, *words)


def test_a_link_into_proc_is_refused(tmp_path):
    link = tmp_path / "config.json"
    link.symlink_to("/proc/self/status")
    _refused(lambda: inputs.read_json(link), str(link), "/proc")


def test_a_socket_a_directory_nothing_and_a_dangling_link(tmp_path):
    import socket

    sock_path = tmp_path / "s.json"
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(sock_path))
        _refused(lambda: inputs.read_json(sock_path), str(sock_path), "socket")
    finally:
        s.close()
    _refused(lambda: inputs.read_json(tmp_path), str(tmp_path), "directory", "JSON")
    _refused(lambda: inputs.read_json(tmp_path / "none.json"), "none.json", "not found")
    dangling = tmp_path / "gone.json"
    dangling.symlink_to(tmp_path / "nowhere")
    _refused(lambda: inputs.read_json(dangling), "gone.json", "target is missing")


def test_a_file_bigger_than_its_kind_can_need_is_refused_unread(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(2 << 20)  # sparse: costs no disk
    line = _refused(lambda: inputs.read_json(big, limit=1 << 20), str(big), "2,097,152 bytes", "1,048,576")
    assert "JSON" in line


def test_json_lines_name_the_file_and_line(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_text('{"a": 1}\n\n[1]\n')
    _refused(lambda: inputs.read_jsonl(f, 1 << 20), str(f), "line 3", "not a JSON object")
    f.write_text('{"a": 1}\n' + "[" * 100_000 + "\n")
    _refused(lambda: inputs.read_jsonl(f, 1 << 20), str(f), "line 2", "nested")
    f.write_text('{"a": 1}\n{"label": ' + "9" * 5000 + "}\n")
    _refused(lambda: inputs.read_jsonl(f, 1 << 20), str(f), "line 2")
    f.write_text('{"a": 1}\n{"t": "' + "x" * 3000 + '"}\n')
    _refused(lambda: inputs.read_jsonl(f, 1 << 20, line_limit=1000), str(f), "line 2", "3,009 bytes")
    f.write_text('{"a": 1}\n\n{"b": 2}\r\n')
    assert inputs.read_jsonl(f, 1 << 20) == [(1, {"a": 1}), (3, {"b": 2})]


def test_an_fd_from_the_gate_is_a_regular_file_opened_blocking(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc")
    fd = inputs.open_fd(f)
    try:
        assert os.get_blocking(fd) and os.read(fd, 3) == b"abc"
    finally:
        os.close(fd)


def test_eval_data_that_is_a_fifo_or_a_device_ends_in_one_line(tmp_path):
    """The command itself: no model loads, nothing hangs (the FIFO has no writer: an open would block for ever)."""
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    for data in (fifo, "/dev/zero"):
        r = subprocess.run([sys.executable, "-m", "gpt2port", "eval", "gpt2", "--task", "lambada", "--data",
                            str(data)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert r.returncode == 1, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and str(data) in lines[0] and "internal error" not in lines[0], r.stderr
