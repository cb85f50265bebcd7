"""The modules of ``throttle/`` import one another without a circle.

Every import counts: at module level, inside a function, and under ``TYPE_CHECKING`` (a
circle there still means two modules that cannot be read apart). Importing a module's own
package is not an edge: Python runs a package before its modules, whatever they import.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "throttle"


def modules() -> dict[str, Path]:
    """Each module of the package by its dotted name (a package by its own name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of the package that ``name`` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    wanted: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            wanted += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            wanted += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    found = set()
    for imported in wanted:
        target = imported
        while target and target not in known:  # a name imported from a module: the module
            target = target.rpartition(".")[0]
        if target and target != name and not name.startswith(target + "."):
            found.add(target)
    return found


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph``, as the modules along it (the first again at the end)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        path.append(name)
        for target in sorted(graph[name]):
            found = visit(target)
            if found:
                return found
        path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        found = visit(name)
        if found:
            return found
    return None


def test_the_search_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circle(graph) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": set()}) is None


def test_no_module_of_the_package_imports_itself_in_a_circle() -> None:
    known = modules()
    assert "throttle.celery.runtime" in known and "throttle.spec" in known
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert "throttle.celery.runtime" in graph["throttle.celery.execution"]  # edges are read
    assert circle(graph) is None, " -> ".join(circle(graph) or [])
