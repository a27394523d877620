"""The package's shape: no import cycles, every module importable on its own terms, no top-level name hiding a
submodule, no module grown past a readable size."""

from __future__ import annotations

import ast
import re
import importlib.util
import subprocess
import sys
from pathlib import Path

import gpt2port

PACKAGE = Path(gpt2port.__file__).parent
ROOT = PACKAGE.parent
MAX_LINES = 420


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every gpt2port module `name` imports, at the top or inside a function (a lazy import is still a dependency).
    `from X import Y` depends on X.Y when that is a module, else on X. A package's own __init__, run implicitly
    before any of its submodules, is not counted as an edge."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


# What a name, a metadata key or a file means for GPT-2: none of it is the file formats' to know.
MEANING = ("gpt2port.config", "gpt2port.layouts", "gpt2port.tokenizer", "gpt2port.model", "gpt2port.readers",
           "gpt2port.targets")


def _meaning_imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """formats/ module -> the modules it imports (at the top or lazily) that give names and keys a meaning."""
    found = {}
    for name, path in modules.items():
        if name == "gpt2port.formats" or name.startswith("gpt2port.formats."):
            bad = {m for m in _imports(name, path, modules) if any(m == p or m.startswith(p + ".") for p in MEANING)}
            if bad:
                found[name] = bad
    return found


def test_the_formats_read_and_write_bytes_and_know_no_gpt2():
    assert _meaning_imports(_modules()) == {}


def test_the_formats_check_sees_an_import_of_meaning(tmp_path):
    bad = tmp_path / "f.py"
    bad.write_text("def f():\n    from gpt2port.layouts.llmc import LLMC\n")
    modules = {"gpt2port.formats.f": bad, "gpt2port.layouts.llmc": PACKAGE / "layouts" / "llmc.py"}
    assert _meaning_imports(modules) == {"gpt2port.formats.f": {"gpt2port.layouts.llmc"}}


# What a reader says a file means (Reader's attributes): set only by gpt2port.readers, never by a format's reader.
MEANING_ATTRIBUTES = ("layout", "model_config", "config_file", "config_keys")


def _meaning_assignments(modules: dict[str, Path]) -> dict[str, set[str]]:
    """formats/ module -> the Reader attributes of meaning it sets (in a class body, or on self), base.py's
    defaults (the protocol) apart."""
    found = {}
    for name, path in modules.items():
        if not name.startswith("gpt2port.formats.") or name == "gpt2port.formats.base":
            continue
        set_here = set()
        tree = ast.parse(path.read_text())
        class_level = {id(s) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for s in c.body}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for t in (e for target in targets for e in (target.elts if isinstance(target, ast.Tuple) else [target])):
                if isinstance(t, ast.Name) and t.id in MEANING_ATTRIBUTES and id(node) in class_level:
                    set_here.add(t.id)  # a class attribute (a function's local of the same name is not one)
                elif isinstance(t, ast.Attribute) and t.attr in MEANING_ATTRIBUTES:
                    set_here.add(t.attr)
        if set_here:
            found[name] = set_here
    return found


def test_the_formats_give_no_file_a_model_meaning():
    """A format's reader lists and reads tensors; which layout they are in and what model sizes go with them
    (hparams.json beside a TensorFlow bundle, GGUF's metadata) is a reader's in gpt2port.readers."""
    assert _meaning_assignments(_modules()) == {}


def test_the_meaning_check_sees_an_attribute_set(tmp_path):
    bad = tmp_path / "f.py"
    bad.write_text("class R:\n    layout = 'x'\n    def __init__(self):\n        self.model_config, n = {}, 1\n"
                   "def f():\n    config_file = 1\n")
    assert _meaning_assignments({"gpt2port.formats.f": bad}) == {"gpt2port.formats.f": {"layout", "model_config"}}


def test_the_cycle_check_sees_a_lazy_cycle(tmp_path, monkeypatch):
    """The check is not vacuous: a cycle made only of imports inside functions is found."""
    a = tmp_path / "a.py"
    a.write_text("def f():\n    from gpt2port.model import GPT\n")
    modules = {"gpt2port.model": PACKAGE / "model.py", "gpt2port.checkpoint": a}
    assert _imports("gpt2port.checkpoint", a, modules) == {"gpt2port.model"}


def test_every_module_imports_in_a_fresh_process_without_transformers():
    names = sorted(n for n in _modules() if n != "gpt2port.__main__")  # that one runs the CLI
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "assert 'transformers' not in sys.modules, 'transformers was imported'\n")
    in_fresh_python(code)


def in_fresh_python(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a new interpreter (nothing imported yet) and insist that it succeeds."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r


def test_no_top_level_name_hides_a_submodule():
    for name in gpt2port.__all__:
        attr = getattr(gpt2port, name)
        spec = importlib.util.find_spec(f"gpt2port.{name}")
        assert spec is None or getattr(attr, "__name__", None) == f"gpt2port.{name}", \
            f"gpt2port.{name} is {attr!r} but also a submodule"


def test_one_function_per_command_at_the_top_level():
    for name in ("convert", "export", "download", "verify", "verify_model", "save", "load_tokenizer"):
        assert callable(getattr(gpt2port, name)), name


def test_no_module_past_a_readable_size():
    big = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_help_and_usage_errors_import_neither_torch_nor_transformers():
    """`gpt2port --help`, each command's --help and a usage error answer at once: the heavy modules load only
    inside the commands that need them."""
    r = in_fresh_python(
        "import sys\n"
        "from gpt2port.cli import main\n"
        "for args in (['--help'], *([c, '--help'] for c in main.commands), ['convert'], ['nonsense']):\n"
        "    try:\n"
        "        main.main(args=args, prog_name='gpt2port')\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors', 'numpy') if m in sys.modules)\n"
        "assert not heavy, f'imported {heavy}'\n")
    assert "Usage: gpt2port" in r.stdout and "No such command 'nonsense'" in r.stderr


def test_the_top_level_names_load_on_first_use():
    in_fresh_python("import sys, gpt2port\n"
                    "assert 'torch' not in sys.modules\n"
                    "assert gpt2port.GPT.__module__ == 'gpt2port.model' and 'torch' in sys.modules\n"
                    "assert set(gpt2port.__all__) <= set(dir(gpt2port))\n"
                    "try:\n"
                    "    gpt2port.nonexistent\n"
                    "except AttributeError as e:\n"
                    "    assert 'nonexistent' in str(e)\n"
                    "else:\n"
                    "    raise AssertionError('no AttributeError')\n")


def test_no_file_cites_a_document_the_project_does_not_contain():
    """The project stands on its own: facts are stated with their source, never as a pointer to a design brief or a
    section of a document that lives outside the repository."""
    # A numbered section of some document (the section sign and a number), or a relative path to a document beside
    # the repository.
    cited = re.compile("\u00a7" + r"\s*\d|\.\./[\w-]+/[\w-]+\.(md|txt|pdf)")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for name in tracked:
        if Path(name).suffix not in (".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".yml", ".yaml") \
                and not name.startswith(".ci/"):
            continue
        for i, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
            if cited.search(line):
                hits.append(f"{name}:{i}: {line.strip()[:80]}")
    assert not hits, "\n".join(hits)


# --- the speed machinery: one optional subpackage, added from outside ----------------------------------------------

def test_the_model_and_its_config_import_nothing_from_the_speed_subpackage():
    modules = _modules()
    for name in ("gpt2port.model", "gpt2port.config", "gpt2port.checkpoint", "gpt2port.layouts"):
        seen, todo = set(), [name]
        while todo:  # everything they import, directly or through other modules
            for dep in _imports(todo[-1], modules[todo.pop()], modules) - seen:
                seen.add(dep)
                todo.append(dep)
        assert not {m for m in seen if m.startswith("gpt2port.fast")}, (name, sorted(seen))


def test_the_model_is_plain_pytorch():
    """No custom operators, no kernel predicates: nn.Linear, the activations, scaled_dot_product_attention."""
    source = (PACKAGE / "model.py").read_text()
    assert "torch.ops" not in source and "torch.jit" not in source
    assert "nn.Linear(" in source and "F.scaled_dot_product_attention(" in source


# What only a block computes: a second place that calls these, or walks a model's parts, in the code that makes
# generation fast is a second copy of the model's arithmetic (one that an edit to model.py would not reach).
BLOCK_ARITHMETIC = {"layer_norm", "rms_norm", "scaled_dot_product_attention", "gelu", "silu", "relu", "ACTIVATIONS"}
MODEL_PARTS = {"blocks", "ln1", "ln2", "final_norm", "attn", "mlp", "qkv", "fc", "act"}
# Probes of a kernel against PyTorch's own function (not the model's) before the kernel is used.
PROBES = {("native.py", "_attends_right"), ("native.py", "_layers_right")}


def _second_forward(path: Path) -> list[str]:
    """Where `path` computes a block's arithmetic or reaches into a model's parts (outside PROBES)."""
    found = []
    tree = ast.parse(path.read_text())
    exempt = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and (path.name, f.name) in PROBES
              for n in ast.walk(f)}
    for node in ast.walk(tree):
        if id(node) in exempt:
            continue
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name in BLOCK_ARITHMETIC or (isinstance(node, ast.Attribute) and name in MODEL_PARTS):
            found.append(f"{path.name}:{node.lineno}: {name}")
    return found


def test_generation_computes_nothing_of_the_model_but_through_its_forward():
    """The decode step is GPT.forward: the speed code and the decoding loop hold no norm, attention, activation or
    walk over a model's blocks of their own (tests/fast/test_edits.py checks the same by running an edited model)."""
    speed = sorted((PACKAGE / "fast").glob("*.py")) + [PACKAGE / "generate.py", PACKAGE / "generate_command.py"]
    found = [hit for path in speed for hit in _second_forward(path)]
    assert not found, found


def test_the_second_forward_check_sees_a_hand_written_step(tmp_path):
    step = tmp_path / "step.py"
    step.write_text("import torch\n"
                    "def forward(model, x):\n"
                    "    for b in model.blocks:\n"
                    "        x = x + b.attn(torch.layer_norm(x, x.shape[-1:]))\n"
                    "    return x\n")
    assert _second_forward(step) == ["step.py:3: blocks", "step.py:4: attn", "step.py:4: layer_norm"]


def test_importing_the_name_tables_registers_no_operators():
    in_fresh_python("import sys, torch\n"
                    "before = set(torch._C._dispatch_get_all_op_names())\n"
                    "import gpt2port.layouts, gpt2port.model\n"
                    "new = sorted(op for op in set(torch._C._dispatch_get_all_op_names()) - before\n"
                    "             if op.startswith('gpt2port'))\n"
                    "assert not new, new\n"
                    "fast = sorted(m for m in sys.modules if m.startswith('gpt2port.fast'))\n"
                    "assert not fast, fast\n")


def test_no_torchscript_in_the_package():
    """TorchScript is deprecated, and PyTorch's torch._C._jit_* graph passes are private: the package uses neither
    (a capture of the forward is torch.export's and AOTInductor's, or a CUDA graph)."""
    import re

    found = [f"{name}: {use}" for name, path in _modules().items()
             for use in re.findall(r"torch\.jit\b[.\w]*|_jit_\w+|torch\._C\._jit\w*", path.read_text())]
    assert not found, found


def _message_matches(tree: ast.AST) -> list[int]:
    """Lines where an except clause decides by its exception's text: `in`/`==` on str(e) (or a name bound from it),
    or str(e).startswith/endswith/find, re.search/match(..., str(e))."""
    hits = []
    for handler in (n for n in ast.walk(tree) if isinstance(n, ast.ExceptHandler) and n.name):
        texts = {handler.name}  # names holding the exception or its text

        def is_text(node) -> bool:
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in ("str", "repr")
                        and sub.args and isinstance(sub.args[0], ast.Name) and sub.args[0].id in texts):
                    return True
                if isinstance(sub, ast.Name) and sub.id in texts - {handler.name}:
                    return True
            return False
        for node in ast.walk(handler):
            if isinstance(node, ast.Assign) and is_text(node.value):
                texts |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(handler):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn, ast.Eq, ast.NotEq))
                                                     for op in node.ops):
                if any(is_text(x) for x in [node.left, *node.comparators]):
                    hits.append(node.lineno)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name = node.func.attr
                if name in ("startswith", "endswith", "find", "index") and is_text(node.func.value):
                    hits.append(node.lineno)
                elif name in ("search", "match", "fullmatch", "findall") and any(is_text(a) for a in node.args):
                    hits.append(node.lineno)
    return hits


def test_no_decision_on_an_exception_s_message_text():
    """An except clause tells failures apart by their type (or a structured attribute), never by their text: a
    library rewording its message silently changes gpt2port's behaviour."""
    hits = {name: lines for name, path in _modules().items()
            if (lines := _message_matches(ast.parse(path.read_text())))}
    assert not hits, hits


def test_the_message_check_sees_a_match():
    code = ("try:\n    f()\nexcept RuntimeError as e:\n    text = str(e)\n    if 'mmap' in text:\n        pass\n"
            "    if str(e).startswith('Symlink'):\n        pass\n")
    assert _message_matches(ast.parse(code)) == [5, 7]


def test_no_unreachable_assertions_in_the_package():
    """Code the reader is told cannot run is restructured until it does not exist (an AssertionError reaching a
    user reads as an internal error)."""
    def raises_assertion(node) -> bool:
        exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        return isinstance(exc, ast.Name) and exc.id == "AssertionError"
    hits = [name for name, path in _modules().items()
            if any(isinstance(n, ast.Raise) and n.exc is not None and raises_assertion(n)
                   for n in ast.walk(ast.parse(path.read_text())))]
    assert not hits, hits


def test_every_broad_except_says_why():
    """ruff's BLE rule is on (pyproject): an except clause that swallows everything is excused only with the
    reason beside it (`# noqa: BLE001 - why`), so the marker is never a bare silencer."""
    marker = re.compile("noqa: " + r"BLE001(?!\s*-+\s*\S)")  # spelt in two so that this line is no marker
    bare = [f"{path.relative_to(ROOT)}:{n}" for part in ("gpt2port", "scripts", "tests")
            for path in sorted((ROOT / part).rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if marker.search(line)]
    assert not bare, bare
    assert "BLE" in (ROOT / "pyproject.toml").read_text().split("[tool.ruff.lint]")[1].split("\n[")[0]


def test_one_module_sets_signal_handlers():
    """SIGINT and SIGTERM are handled in one place (gpt2port.signals) for the commands, the training loop and every
    torchrun rank; a second handler elsewhere would disagree with it on what a second Ctrl-C or an ignored signal
    means."""
    setters = [name for name, path in _modules().items()
               if re.search(r"\bsignal\.(signal|raise_signal|setitimer|pthread_sigmask)\(", path.read_text())]
    assert setters == ["gpt2port.signals"], setters


def test_no_module_level_switches_in_the_speed_code():
    """Settings are passed explicitly (gpt2port.fast.Settings): no ENABLED / SCRIPTED / USE_* globals to flip."""
    switch = re.compile(r"^(ENABLED|SCRIPTED|USE_ONEDNN|ATTEND_ONE|SMOOTHING|DIRECT|last_path)\b", re.M)
    hits = [name for name, path in _modules().items() if switch.search(path.read_text())]
    assert not hits, hits


def _package_graph() -> dict[str, set[str]]:
    """Edges between the package's parts: each subpackage (gpt2port.formats, ...) is one node, each top-level module
    another."""
    modules = _modules()

    def part(name: str) -> str:
        parts = name.split(".")
        sub = ".".join(parts[:2])
        return sub if len(parts) > 2 or (PACKAGE / parts[1]).is_dir() else name

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        if name == "gpt2port":
            continue
        deps = {part(m) for m in _imports(name, path, modules) if m != "gpt2port"}
        graph.setdefault(part(name), set()).update(deps - {part(name)})
    return graph


def test_no_cycles_between_subpackages():
    """Layers, not a web: no subpackage or top-level module reaches back into one that reaches it (userclass uses
    verification, never the reverse; formats know no model)."""
    graph = _package_graph()
    cycles = []
    for a, deps in graph.items():
        for b in deps:
            seen, todo = set(), [b]
            while todo:
                n = todo.pop()
                if n == a:
                    cycles.append(f"{a} -> {b} -> ... -> {a}")
                    break
                if n not in seen:
                    seen.add(n)
                    todo.extend(graph.get(n, ()))
    assert not cycles, sorted(cycles)


def test_one_registry_names_the_targets_the_cli_offers_and_conversion_writes():
    """Every target of targets.REGISTRY is offered by `export --to`, has a layout table (its own, or the one its
    row names) and a writer module, and its encodings are offered by --dtype: one table, nothing kept in step by
    hand."""
    from gpt2port.cli import export
    from gpt2port.layouts import LAYOUTS
    from gpt2port.targets import REGISTRY

    options = {p.name: p for p in export.params}
    assert list(options["to"].type.choices) == list(REGISTRY)
    for name, target in REGISTRY.items():
        assert (target.layout or name) in LAYOUTS and callable(target.writer()), name
        assert set(target.encodings) <= set(options["dtype"].type.choices), name


def test_the_scripts_find_the_repository_root_in_one_place():
    """Scripts start children as `python -m scripts...` from the repository root: scripts.ROOT, the one copy of where
    that is (a copy computed per file went stale when the benchmarks moved into scripts/bench/, and the int8
    round of scripts.bench.generate could no longer start its child)."""
    import scripts

    assert scripts.ROOT == ROOT.resolve()
    own_root = re.compile(r"Path\(__file__\)(\.resolve\(\))?\.parents?\b")
    computed = [str(p.relative_to(ROOT)) for p in (ROOT / "scripts").rglob("*.py")
                if p.name != "__init__.py" and own_root.search(p.read_text())]
    assert computed == [], f"use scripts.ROOT: {computed}"
