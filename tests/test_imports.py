"""The import graph of ``src/kvkeep``: no cycle, and nothing below bench imports bench.

The graph is read with ``ast`` (no module is imported), and every import statement counts,
also those inside a function: an import deferred to call time is still a dependency, and a
cycle hidden that way breaks as soon as someone moves the import to the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
# Packages that bench builds on and that must never import it (plan replays bench results
# from their JSON alone; the store, server and connector know nothing of measurements).
BELOW_BENCH = (
    "kvkeep.plan",
    "kvkeep.store",
    "kvkeep.server",
    "kvkeep.vllm",
    "kvkeep.host",
    "kvkeep.launch",
    "kvkeep.traffic",
    "kvkeep.tinymodel",
)


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(src: Path) -> dict[str, set[str]]:
    """{module: kvkeep modules it imports}, for every module under ``src/kvkeep``."""
    paths = {module_name(p, src): p for p in sorted((src / "kvkeep").rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, package)
                targets.add(base)
                targets.update(f"{base}.{a.name}" for a in node.names)
        graph[name] = {_owner(t, paths) for t in targets if _owner(t, paths)} - {name}
    return graph


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def _owner(target: str, modules: dict[str, Path]) -> str:
    """The module ``target`` names, or the longest module it lies in ('' if none of ours)."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None. Depth-first, three colours."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _is_in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_graph_sees_imports_inside_functions_and_packages() -> None:
    graph = import_graph(SRC)
    assert "kvkeep.bench.criterion" in graph and "kvkeep.plan" in graph
    assert any(_is_in(m, "kvkeep.bench") for m in graph["kvkeep.demo"])


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph(SRC))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("package", BELOW_BENCH)
def test_nothing_below_bench_imports_bench(package: str) -> None:
    graph = import_graph(SRC)
    bad = sorted(
        f"{m} imports {t}"
        for m, targets in graph.items()
        if _is_in(m, package)
        for t in targets
        if _is_in(t, "kvkeep.bench")
    )
    assert not bad, "\n".join(bad)


def test_cycle_finder_finds_a_cycle_through_a_deferred_import(tmp_path: Path) -> None:
    pkg = tmp_path / "kvkeep"
    (pkg / "bench").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "bench" / "__init__.py").write_text("")
    (pkg / "bench" / "a.py").write_text("from kvkeep.bench import b\n")
    (pkg / "bench" / "b.py").write_text("def f():\n    from . import a\n")
    graph = import_graph(tmp_path)
    assert find_cycle(graph) in (
        ["kvkeep.bench.a", "kvkeep.bench.b", "kvkeep.bench.a"],
        ["kvkeep.bench.b", "kvkeep.bench.a", "kvkeep.bench.b"],
    )
