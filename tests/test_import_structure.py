"""The installed package's import graph, read from the source by AST (nothing is imported).

Modules are named as installed: ``fp8sim/`` -> ``fp8sim.*``, ``kernels/`` -> ``fp8sim.kernels.*``,
``analysis/`` -> ``fp8sim.analysis.*``, ``cli.py`` -> ``fp8sim.cli`` (pyproject.toml's
``[tool.setuptools]`` ``packages`` and ``package-dir`` say which folder is which package).

An import statement counts as *module-level* when it runs while its module is being imported: at
the top of the file, in a class body, under a module-level ``if``/``try``. One inside a function
runs later, when the function is called; one under ``if TYPE_CHECKING:`` never runs. A cycle of
module-level imports is a defect: whichever module of it is imported first sees the others half
initialised, so the program works or fails by import order. (Imports inside functions may close a
cycle; that is the usual way to break one, and is counted separately.)

Edges: ``import a.b`` and ``from a import b`` (``b`` a module) point to ``a.b``; ``from a.b import
name`` points to ``a.b``. An edge to a module's own parent packages is not counted: Python has
always started importing those first, so they cannot close a cycle that import order decides.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE, FUNCTION, TYPE_CHECKING = "module", "function", "type_checking"


def _installed_modules() -> dict[str, Path]:
    """Installed module name -> source file, by pyproject.toml's packages and package-dir."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        tomllib = pytest.importorskip("tomli")
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = setup.get("package-dir", {})
    modules: dict[str, Path] = {}
    for pkg in setup["packages"]:
        # the folder of the longest mapped prefix, then the rest of the dotted name below it
        prefix = max((p for p in package_dir if pkg == p or pkg.startswith(p + ".")), key=len,
                     default="")  # fmt: skip
        rest = pkg[len(prefix):].lstrip(".").replace(".", "/")
        folder = ROOT / package_dir.get(prefix, "") / rest
        for f in sorted(folder.glob("*.py")):
            name = pkg if f.name == "__init__.py" else f"{pkg}.{f.stem}"
            modules[name] = f.resolve()  # fp8sim/cli.py is a link to the root cli.py
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")  # fmt: skip


def _imports(tree: ast.AST):
    """(node, kind) of every import statement; kind: MODULE, FUNCTION or TYPE_CHECKING."""

    def walk(node: ast.AST, kind: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, kind
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, FUNCTION if kind == MODULE else kind)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]),
                                    TYPE_CHECKING if kind == MODULE else kind)  # fmt: skip
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), kind)
            else:
                yield from walk(child, kind)

    yield from walk(tree, MODULE)


def import_graph() -> dict[str, dict[str, set[str]]]:
    """kind -> {module: modules of this package it imports with imports of that kind}."""
    modules = _installed_modules()
    graph = {kind: {m: set() for m in modules} for kind in (MODULE, FUNCTION, TYPE_CHECKING)}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py" and name != "fp8sim.cli"
        package = name if is_pkg else name.rpartition(".")[0]
        for node, kind in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]  # fmt: skip
            for t in targets:
                while t and t not in modules:  # `import fp8sim.x.y` names y; a name in y too
                    t = t.rpartition(".")[0]
                if t and t != name and not name.startswith(t + "."):
                    graph[kind][name].add(t)
    return graph


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_graph_sees_the_packages_and_their_imports():
    # the test must be able to fail: known modules are found, and known edges of each kind
    g = import_graph()
    for m in ("fp8sim", "fp8sim.cli", "fp8sim.kernels", "fp8sim.analysis.policy_replay",
              "fp8sim.trace", "fp8sim.trace.writer", "fp8sim.training.recorder"):  # fmt: skip
        assert m in g[MODULE], m
    assert "fp8sim.trace.layout" in g[MODULE]["fp8sim.trace.writer"]
    assert "fp8sim.trace" in g[MODULE]["fp8sim.analysis.policy_replay"]
    assert "fp8sim.trace" in g[FUNCTION]["fp8sim.analysis.allreduce_replay"]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_every_package_folder_is_installed():
    # a subpackage missing from pyproject's list works in the editable install and is absent
    # from the wheel
    modules = _installed_modules()
    for root in {p.parent for m, p in modules.items() if p.name == "__init__.py"}:
        for init in root.glob("*/__init__.py"):
            assert init.resolve() in modules.values(), f"{init.parent} is not in pyproject packages"


def test_no_module_level_import_cycle():
    assert import_cycles(import_graph()[MODULE]) == []


def test_the_trace_package_needs_no_function_level_import_to_break_a_cycle():
    # the format, writer, reader and truncation import one another in one direction only
    g = import_graph()
    edges = {m: g[MODULE][m] | g[FUNCTION][m] for m in g[MODULE]}
    cycles = import_cycles(edges)
    assert not [c for c in cycles if any(m.split(".")[:2] == ["fp8sim", "trace"] for m in c)]


def test_the_trace_package_imports_only_the_core():
    # the trace format lives in the core so that training (writes) and analysis (reads) never
    # import each other: it must not import either of them, the kernels or the CLI
    outside_core = ("training", "analysis", "kernels", "backends", "cli", "commands")
    g = import_graph()
    for kind in (MODULE, FUNCTION):
        for m, targets in g[kind].items():
            if m.split(".")[:2] == ["fp8sim", "trace"]:
                bad = [t for t in targets if "." in t and t.split(".")[1] in outside_core]
                assert not bad, (m, kind, bad)


#: the one private package other modules may import private helpers from: numba plumbing
PRIVATE_HELPERS = "fp8sim._numba"


def _private_imports() -> list[str]:
    """``module:line name`` for every import of another module's private object or module
    (a name or path part starting with one underscore), outside :data:`PRIVATE_HELPERS`."""
    def private(part: str) -> bool:
        return part.startswith("_") and not part.startswith("__")

    found = []
    for mod, path in _installed_modules().items():
        own_pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if not node.module.startswith("fp8sim"):
                    continue
                target = node.module
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names, target = [], None
                for a in node.names:
                    if a.name.startswith("fp8sim") and any(map(private, a.name.split("."))):
                        if not (a.name + ".").startswith(PRIVATE_HELPERS + "."):
                            found.append(f"{mod}:{node.lineno} import {a.name}")
                continue
            else:
                continue
            if (target + ".").startswith(PRIVATE_HELPERS + "."):
                continue
            if target == mod:
                continue
            modules = _installed_modules()
            # a package's own private submodules are its business: ``from pkg import _mod``
            bad = [n for n in names if private(n)
                   and not (target == own_pkg and f"{target}.{n}" in modules)]
            if any(map(private, target.split("."))) and target.rpartition(".")[0] != own_pkg:
                bad.append(f"(module {target})")
            found += [f"{mod}:{node.lineno} from {target} import {n}" for n in bad]
    return found


def test_no_module_imports_another_modules_private_names():
    assert _private_imports() == []


def test_the_private_import_check_sees_a_violation(tmp_path, monkeypatch):
    bad = tmp_path / "bad.py"
    bad.write_text("from fp8sim.emulator import _is_torch\nfrom fp8sim._numba.jit import jit_kernel\n")
    real = _installed_modules()
    monkeypatch.setitem(globals(), "_installed_modules", lambda: {**real, "fp8sim.bad": bad})
    assert _private_imports() == ["fp8sim.bad:1 from fp8sim.emulator import _is_torch"]


def _third_party_imports(name: str) -> list[str]:
    """``module:line`` of every import of the top-level package ``name`` (any kind of import)."""
    found = []
    for mod, path in _installed_modules().items():
        for node, _ in _imports(ast.parse(path.read_text(), str(path))):
            roots = ([a.name.split(".")[0] for a in node.names] if isinstance(node, ast.Import)
                     else [(node.module or "").split(".")[0]] if node.level == 0 else [])  # fmt: skip
            if name in roots:
                found.append(f"{mod}:{node.lineno}")
    return found


def test_only_the_kernels_import_triton():
    # docs/design.md: "Triton is imported only by fp8sim.kernels"; the triton backend and the
    # conformance report reach it through fp8sim.kernels
    found = _third_party_imports("triton")
    assert found and all(f.startswith("fp8sim.kernels.") for f in found), found


def _numba_compiles() -> list[str]:
    """``module:line`` of every call or decorator ``numba.njit`` / ``numba.jit`` / ``njit`` /
    ``jit`` / ``numba.vectorize`` outside :data:`PRIVATE_HELPERS` (the one place for flags)."""
    found = []
    for mod, path in _installed_modules().items():
        if (mod + ".").startswith(PRIVATE_HELPERS + "."):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            f = node.func if isinstance(node, ast.Call) else node
            name = (f.attr if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                    and f.value.id == "numba" else f.id if isinstance(f, ast.Name) else None)  # fmt: skip
            if name in ("njit", "jit", "vectorize", "guvectorize", "cfunc") and isinstance(node, (ast.Call, ast.Name)):
                if isinstance(f, ast.Name) and not _imported_from_numba(path, name):
                    continue
                found.append(f"{mod}:{node.lineno}")
    return found


def _imported_from_numba(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text(), str(path))
    return any(isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "numba"
               and any(a.name == name for a in n.names) for n in ast.walk(tree))  # fmt: skip


def test_numba_compile_flags_live_in_one_place():
    # docs/design.md: "numba compile flags live in one place (fp8sim/_numba/jit.py)"
    assert _numba_compiles() == []


def test_the_numba_check_sees_a_violation(tmp_path, monkeypatch):
    bad = tmp_path / "bad.py"
    bad.write_text("import numba\n\n@numba.njit(cache=True)\ndef f(x):\n    return x\n")
    real = _installed_modules()
    monkeypatch.setitem(globals(), "_installed_modules", lambda: {**real, "fp8sim.bad": bad})
    assert _numba_compiles() == ["fp8sim.bad:3"]


#: the layers, bottom up (docs/design.md): a module imports only from its own layer and those
#: below, at module level or inside a function
LAYERS = ("core", "kernels", "backends", "training", "analysis", "cli")
#: training and analysis are siblings: neither imports the other
BELOW = {"core": {"core"}, "kernels": {"core", "kernels"}, "backends": {"core", "kernels", "backends"},
         "training": {"core", "kernels", "backends", "training"},
         "analysis": {"core", "kernels", "backends", "analysis"}, "cli": set(LAYERS)}  # fmt: skip
#: modules outside fp8sim.backends that stand at the backends' level, and why
BACKEND_LEVEL = {
    "fp8sim.allreduce_sim": "encodes the ranks' gradients through a backend",
    "fp8sim.conformance": "checks Triton's native cast (fp8sim.kernels.native_cast)",
    "fp8sim.testing": "checks a user's kernel on the backends' edge cases",
}


def layer_of(module: str) -> str:
    if module in ("fp8sim.cli", "fp8sim.__main__") or module.startswith("fp8sim.commands"):
        return "cli"
    if any(module == m or module.startswith(m + ".") for m in BACKEND_LEVEL):
        return "backends"
    for name in ("training", "analysis", "backends", "kernels"):
        if module == f"fp8sim.{name}" or module.startswith(f"fp8sim.{name}."):
            return name
    return "core"


def layering_violations(graph) -> list[str]:
    return [f"{m} ({layer_of(m)}) imports {t} ({layer_of(t)}) [{kind}]"
            for kind in (MODULE, FUNCTION) for m, targets in sorted(graph[kind].items())
            for t in sorted(targets) if layer_of(t) not in BELOW[layer_of(m)]]  # fmt: skip


def test_the_layers_import_downwards_only():
    # core <- kernels <- backends <- training | analysis <- the CLI (every command and the demo)
    assert layering_violations(import_graph()) == []


def test_the_layering_check_sees_violations():
    g = {MODULE: {"fp8sim.analysis.x": {"fp8sim.training.y"}, "fp8sim.scaling": set()},
         FUNCTION: {"fp8sim.scaling": {"fp8sim.commands.train"}, "fp8sim.training.y": {"fp8sim.analysis.x"}}}
    assert len(layering_violations(g)) == 3
    assert layer_of("fp8sim.commands.demo") == "cli" and layer_of("fp8sim.testing.scaled") == "backends"
