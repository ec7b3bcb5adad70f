"""The import graph of ``specattn``, built from the source (``ast``): no circles, a core that
does not import the backends, vendor modules that do not import each other, and no
production module that imports the sparse reference.

An edge is every import a module makes, wherever it is written: at module level, inside a
function (it runs when the function does, and closes a circle as surely as a module-level
one), under ``if TYPE_CHECKING:`` (the annotations depend on it) and through
``importlib.import_module`` / ``__import__`` of a literal name. Importing ``a.b.c`` also runs
the ``__init__`` of ``a`` and ``a.b``; those parent-package edges are left out (Python
resolves a submodule of a package still initialising, and every module would otherwise sit
in one circle with ``specattn``), but importing a name *from* a package is an edge to it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "specattn"
BACKENDS = "specattn.backends"
# Modules that exist to reach every backend (registration, listing, benchmarks, demos), and
# their submodules (the package root itself only).
BACKEND_USERS = ("specattn.cli", "specattn.listing", "specattn.bench", "specattn.demo",
                 "specattn.testing")


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the package at ``root``."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(current: str, is_package: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = current.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _dynamic_target(node: ast.Call, current: str, is_package: bool) -> str | None:
    """The module ``importlib.import_module("x")`` / ``__import__("x")`` names (a literal;
    relative names resolve against the caller's package)."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__") or not node.args:
        return None
    first = node.args[0]
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return None
    text = first.value
    level = len(text) - len(text.lstrip("."))
    return _resolve(current, is_package, level, text[level:] or None) if level else text


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_package, node.level, node.module)
            # ``from pkg import mod`` imports the submodule; ``from mod import name`` the module.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        elif isinstance(node, ast.Call):
            targets = [_dynamic_target(node, name, is_package)]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _vendor(name: str, backends: str) -> str | None:
    """``<backends>.<vendor>`` of a module under it (``None`` elsewhere and for the
    ``backends`` package itself)."""
    parts = name.split(".")
    depth = len(backends.split("."))
    return ".".join(parts[:depth + 1]) if name.startswith(backends + ".") else None


def cross_vendor_edges(graph: dict[str, set[str]], backends: str) -> list[tuple[str, str]]:
    """``(importer, imported)``: a module under ``backends`` importing a module under it (the
    package itself included: it imports every backend) outside its own vendor."""
    bad = []
    for m, targets in graph.items():
        own = _vendor(m, backends)
        if own is None:
            continue
        for t in sorted(targets):
            if (t == backends or t.startswith(backends + ".")) and _vendor(t, backends) != own:
                bad.append((m, t))
    return sorted(bad)


GRAPH = import_graph(ROOT)


# --- the graph builder, on packages made for the purpose -----------------------------------------

def _package(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for rel, text in files.items():
        f = tmp_path / "pkg" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    for d in [tmp_path / "pkg", *(p for p in (tmp_path / "pkg").rglob("*") if p.is_dir())]:
        (d / "__init__.py").touch()
    return import_graph(tmp_path / "pkg")


@pytest.mark.parametrize("b_text", [
    "from . import a\n",
    "def f():\n    from .a import thing\n    return thing\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import Thing\n",
    "import importlib\n\ndef f():\n    return importlib.import_module('pkg.a')\n",
    "import importlib\n\ndef f():\n    return importlib.import_module('.a', __package__)\n",
    "def f():\n    return __import__('pkg.a')\n",
    "class C:\n    def m(self):\n        import pkg.a\n",
], ids=["module-level", "function-level", "type-checking", "import-module",
        "import-module-relative", "dunder-import", "method-level"])
def test_a_circle_closed_by_any_import_is_found(tmp_path, b_text):
    graph = _package(tmp_path, {"a.py": "from .b import g\n", "b.py": b_text})
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


def test_no_circle_without_a_way_back(tmp_path):
    graph = _package(tmp_path, {"a.py": "from .b import g\n",
                                "b.py": "import importlib\nX = importlib.import_module(NAME)\n",
                                "c.py": "from . import a, b\n"})
    assert graph["pkg.c"] == {"pkg.a", "pkg.b"}
    assert cycles(graph) == []


def test_cross_vendor_edges_are_found(tmp_path):
    graph = _package(tmp_path, {
        "backends/__init__.py": "from . import one, two, three\n",
        "backends/one.py": "from .. import core\n",
        "backends/two.py": "def f():\n    from .one import x\n",
        "backends/three/backend.py": "from . import _k\nfrom ..one import y\n",
        "backends/three/_k.py": "import pkg.backends\n",
        "core.py": "",
    })
    assert cross_vendor_edges(graph, "pkg.backends") == [
        ("pkg.backends.three._k", "pkg.backends"),
        ("pkg.backends.three.backend", "pkg.backends.one"),
        ("pkg.backends.two", "pkg.backends.one"),
    ]


# --- specattn -----------------------------------------------------------------------------------

def test_the_graph_sees_the_edges_it_should():
    """Relative, package, function-level and TYPE_CHECKING imports all resolve."""
    assert "specattn.base" in GRAPH["specattn.factory"]
    assert "specattn.validation" in GRAPH["specattn.backends.dsa.backend"]  # from ... import
    assert "specattn.kernels.history_merge" in GRAPH["specattn.backends.flashmla"]  # lazy
    assert "specattn.data" in GRAPH["specattn.base"]  # TYPE_CHECKING
    assert len(GRAPH) > 60


def test_data_and_validation_depend_one_way():
    assert "specattn.data" in GRAPH["specattn.validation"]
    assert "specattn.validation" not in GRAPH["specattn.data"]


def test_no_import_circles():
    found = cycles(GRAPH)
    assert not found, f"import circles: {found}"


def test_core_does_not_import_backends():
    """Core modules (everything but the backends and the modules that exist to reach them)
    import no backend: a backend may use the core, not the other way round."""
    bad = {m: sorted(t for t in GRAPH[m] if t.startswith(BACKENDS))
           for m in GRAPH if not m.startswith(BACKENDS) and m != "specattn"
           and not any(m == u or m.startswith(u + ".") for u in BACKEND_USERS)}
    assert not {m: t for m, t in bad.items() if t}


def test_no_vendor_module_imports_another():
    """Every module under ``specattn/backends/`` belongs to one vendor (a module, or a package
    folder) and imports no backend module outside it; what vendors share lives in the core
    (``specattn.kernels``, ...)."""
    assert cross_vendor_edges(GRAPH, BACKENDS) == []


def test_no_production_module_imports_the_sparse_reference():
    users = sorted(m for m, t in GRAPH.items() if f"{BACKENDS}.torch_ref_sparse" in t)
    assert users == []
