"""The runtime's packages import each other without a cycle (lazy imports inside functions
included): each package can be read, tested and replaced from the ones below it."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime"


def package_imports() -> dict[str, set[str]]:
    """package -> the runtime packages its modules import (top-level modules count as packages)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path in RUNTIME.rglob("*.py"):
        parts = path.relative_to(RUNTIME).parts
        source = parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                bits = name.split(".")
                if bits[:2] == ["liveshard", "runtime"] and len(bits) > 2 and bits[2] != source:
                    edges[source].add(bits[2])
    return edges


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among packages (directories), or None."""
    packages = {p.name for p in RUNTIME.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, set()) & packages):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for p in sorted(packages):
        if p not in state and (found := visit(p)):
            return found
    return None


def test_no_import_cycle_between_runtime_packages():
    found = cycle(package_imports())
    assert found is None, " -> ".join(found or [])


def test_the_cycle_finder_finds_one():
    assert cycle({"agent": {"megatron"}, "megatron": {"agent"}}) in (["agent", "megatron", "agent"],
                                                                    ["megatron", "agent", "megatron"])
