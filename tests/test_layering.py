"""The package's floors, read from its source: who may reach into the engine, and who may import whom.

Layout, one way down: entrypoints -> engine -> kv (pure Python) and models -> ops; bench and viz beside,
reading the engine's public face (stats(), kv_snapshot(), step observers) and importing each other
without cycles. Every import counts, those inside functions too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pagedllm

ROOT = Path(pagedllm.__file__).parent
ENGINE_INTERNALS = {"scheduler", "allocator", "runner", "requests"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in SOURCES.items()}


def imported_modules(name: str) -> set[str]:
    """The pagedllm modules `name` imports: `from pagedllm.viz import figures` is pagedllm.viz.figures
    where that is a module, else pagedllm.viz."""
    found = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in SOURCES else node.module)
    return {module for module in found if module == "pagedllm" or module.startswith("pagedllm.")}


GRAPH = {name: imported_modules(name) for name in SOURCES}


def within(module: str, *packages: str) -> bool:
    return any(module == f"pagedllm.{p}" or module.startswith(f"pagedllm.{p}.") for p in packages)


def test_the_graph_sees_imports_inside_functions_and_from_package_imports():
    """The reader itself: a top-level, a lazy and a `from package import module` edge of known files."""
    assert "pagedllm.kv" in GRAPH["pagedllm.engine.llm_engine"]
    assert "pagedllm.entrypoints.llm" in GRAPH["pagedllm"]  # inside __getattr__
    assert "pagedllm.sampling_params" in GRAPH["pagedllm"]  # `from pagedllm import sampling_params`


def test_nothing_outside_the_engine_reads_its_scheduler_allocator_runner_or_requests():
    """Outside pagedllm/engine/, no `x.scheduler`, `x.allocator`, `x.runner` or `x.requests`: callers use
    the engine's face. (`from starlette.requests import Request` names a module, not an attribute.)"""
    reads = sorted(
        (str(SOURCES[name].relative_to(ROOT.parent)), node.lineno, node.attr)
        for name, tree in TREES.items()
        if not within(name, "engine")
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS
    )
    lines = [f"{path}:{line} .{attr}" for path, line, attr in reads]
    assert not reads, "\n".join(["the engine's internals read outside it:", *lines])


# Each floor and the packages it must not import.
FLOORS = {
    "kv": None,  # nothing of pagedllm but itself
    "ops": ("models", "engine", "entrypoints", "bench", "viz"),
    "models": ("engine", "entrypoints", "bench", "viz"),
    "engine": ("entrypoints", "bench", "viz"),
}


@pytest.mark.parametrize("floor", FLOORS)
def test_each_floor_imports_only_downwards(floor):
    forbidden = FLOORS[floor]
    bad = sorted(
        f"{name} imports {module}"
        for name, modules in GRAPH.items()
        if within(name, floor)
        for module in modules
        if (not within(module, floor) if forbidden is None else within(module, *forbidden))
    )
    assert not bad, "\n".join(["imports up or across the floors:", *bad])


def test_bench_and_viz_are_imported_only_by_the_cli_and_each_other():
    bad = sorted(
        f"{name} imports {module}"
        for name, modules in GRAPH.items()
        if not within(name, "bench", "viz") and name != "pagedllm.entrypoints.cli"
        for module in modules
        if within(module, "bench", "viz")
    )
    assert not bad, "\n".join(["bench or viz imported from below:", *bad])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each module that lies on one (depth-first search), as [a, b, ..., a]."""
    found, state = [], {}  # state: 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle_and_passes_a_tree():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_bench_and_viz_import_each_other_without_cycles():
    tools = {name for name in GRAPH if within(name, "bench", "viz")}
    found = cycles({name: GRAPH[name] & tools for name in tools})
    assert not found, "\n".join(["import cycles:", *(" -> ".join(cycle) for cycle in found)])
