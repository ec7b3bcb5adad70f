"""The import graph of ``specattn``, built from the source (``ast``): no circles, a core that
does not import the backends, vendor modules that do not import each other, and no
production module that imports the sparse reference.

An edge is any ``import`` / ``from ... import`` in a module (function-level imports included:
they are dependencies too), except those under ``if TYPE_CHECKING:``.
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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(current: str, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = current.split(".")
    if not _is_package(current):
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def _imports(name: str) -> set[str]:
    """The ``specattn`` modules that module ``name`` imports."""
    tree = ast.parse(MODULES[name].read_text())
    skip = _type_checking_lines(tree)
    found = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, node.level, node.module)
            # ``from pkg import mod`` imports the submodule; ``from mod import name`` the module.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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


def _vendor(name: str) -> str | None:
    """``specattn.backends.<vendor>`` of a module under it (``None`` elsewhere)."""
    parts = name.split(".")
    return ".".join(parts[:3]) if name.startswith(BACKENDS + ".") else None


def test_the_graph_sees_the_edges_it_should():
    """Meta-test: relative, package and function-level imports all resolve."""
    assert "specattn.base" in GRAPH["specattn.factory"]
    assert "specattn.validation" in GRAPH["specattn.backends.dsa.backend"]  # from ... import
    assert "specattn.kernels.history_merge" in GRAPH["specattn.backends.flashmla"]  # lazy
    assert "specattn.data" in GRAPH["specattn.validation"]
    assert "specattn.validation" not in GRAPH["specattn.data"]
    assert len(GRAPH) > 60


def test_no_import_circles():
    cycles = _cycles(GRAPH)
    assert not cycles, f"import circles: {cycles}"


def test_core_does_not_import_backends():
    """Core modules (everything but the backends and the modules that exist to reach them)
    import no backend: a backend may use the core, not the other way round."""
    bad = {m: sorted(t for t in GRAPH[m] if t.startswith(BACKENDS))
           for m in GRAPH if not m.startswith(BACKENDS) and m != "specattn"
           and not any(m == u or m.startswith(u + ".") for u in BACKEND_USERS)}
    assert not {m: t for m, t in bad.items() if t}


def test_no_vendor_module_imports_another():
    bad = []
    for m, targets in GRAPH.items():
        own = _vendor(m)
        for t in targets:
            other = _vendor(t)
            if own and other and other != own:
                bad.append((m, t))
    assert not bad


def test_no_production_module_imports_the_sparse_reference():
    users = sorted(m for m, t in GRAPH.items() if f"{BACKENDS}.torch_ref_sparse" in t)
    assert users == []
