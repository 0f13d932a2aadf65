"""The package's import graph has no cycle.

Every ``import`` inside ``src/durably`` counts — module level, inside functions and under
``TYPE_CHECKING`` alike — because a lazy or type-only import that closes a loop is still a
design cycle: the lower module reaches into the higher one's objects. With no cycle, the modules
order into layers and every import points down.
"""

from __future__ import annotations

import ast
from pathlib import Path

import durably

PACKAGE_ROOT = Path(durably.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def import_graph() -> dict[str, set[str]]:
    """Each ``durably`` module mapped to the ``durably`` modules it imports."""
    files = {_module_name(p): p for p in PACKAGE_ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = _resolve(name, is_package, node)
                # `from . import x` names a submodule when one exists, else an attribute.
                targets = [
                    f"{module}.{alias.name}" if f"{module}.{alias.name}" in files else module
                    for alias in node.names
                ]
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target.startswith("durably") and target != name:
                    # Importing a submodule runs its package's __init__ first, but that edge is
                    # the package's own business, not the importer's: only the named module counts.
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _edges_inside(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    members = set(component)
    return [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    found = cycles(graph)
    described = "\n".join(
        "cycle: " + ", ".join(component) + "\n  " + "\n  ".join(_edges_inside(graph, component))
        for component in found
    )
    assert not found, f"import cycles in src/durably:\n{described}"


def test_the_checker_sees_a_cycle_hidden_in_a_function() -> None:
    graph = {"durably.a": {"durably.b"}, "durably.b": {"durably.a"}, "durably.c": set()}
    assert cycles(graph) == [["durably.a", "durably.b"]]
