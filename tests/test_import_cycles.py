"""No import cycle in pipecc/ or runtime/, counting every import: at module level, under
`TYPE_CHECKING` and inside functions alike (a cycle hidden by a local import is still one
design knot). The layering test (test_layering.py) holds imports to the layers' order; this
one also catches a cycle inside one layer, such as two engine modules importing each other."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (("pipecc", "pipecc"), ("runtime", "pipecc.runtime"))


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for folder, package in PACKAGES:
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join([package, *parts])] = (path, is_package)
    return found


def _targets(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    module = node.module or ""
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        module = ".".join([*base, *([module] if module else [])])
    return [module, *(f"{module}.{alias.name}" for alias in node.names)]


def import_graph() -> nx.DiGraph:
    """Module -> every module of pipecc it imports (the nearest known module of a name)."""
    modules = _modules()
    graph = nx.DiGraph()
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _targets(node, package):
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph.add_edge(name, target)
    return graph


def test_no_import_cycle_anywhere() -> None:
    cycles = [c for c in nx.simple_cycles(import_graph()) if len(c) > 1]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


def test_a_cycle_is_found_when_there_is_one() -> None:
    graph = import_graph()
    graph.add_edge("pipecc.runtime.engine.context", "pipecc.runtime.engine.steps")
    assert graph.has_edge("pipecc.runtime.engine.steps", "pipecc.runtime.engine.context")
    assert any(len(c) > 1 for c in nx.simple_cycles(graph))
