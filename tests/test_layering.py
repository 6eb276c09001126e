"""The package's floors, read from its source: who may reach into the engine, and who may import whom.

Layout, one way down: entrypoints -> engine -> kv (pure Python) and models -> ops; bench and viz beside,
reading the engine's public face (stats(), kv_snapshot(), run_info(), step observers; PUBLIC below) but
for the component benchmarks the allow-lists name, each with its reason. Every import counts, those
inside functions too (a lazy import is still a dependency), and so does a module loaded by its name
(`importlib.import_module("pagedllm.bench.memory")`, as the CLI loads the benchmarks). No import circle
anywhere; nothing below bench/, viz/ and entrypoints/ imports them.
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


def imported_names(name: str) -> set[tuple[str, str | None]]:
    """(module, name) for each thing `name` imports from pagedllm: `from pagedllm.kv import KVUsage` is
    (pagedllm.kv, KVUsage), `from pagedllm.viz import figures` (pagedllm.viz.figures, None) where that is
    a module, `import pagedllm.x` (pagedllm.x, None); in a module that calls import_module, a string that
    is exactly a module's name (loaded by name) counts as importing it."""
    tree, found = TREES[name], set()
    by_name = any(
        isinstance(node, ast.Call)
        and "import_module" in (getattr(node.func, "attr", None), getattr(node.func, "id", None))
        for node in ast.walk(tree)
    )
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(alias.name, None) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add((submodule, None) if submodule in SOURCES else (node.module, alias.name))
        elif by_name and isinstance(node, ast.Constant) and node.value in SOURCES:
            found.add((node.value, None))
    return {
        (module, what) for module, what in found if module == "pagedllm" or module.startswith("pagedllm.")
    }


def imported_modules(name: str) -> set[str]:
    """The pagedllm modules `name` imports (imported_names' modules)."""
    return {module for module, _ in imported_names(name)}


GRAPH = {name: imported_modules(name) for name in SOURCES}


def within(module: str, *packages: str) -> bool:
    return any(module == f"pagedllm.{p}" or module.startswith(f"pagedllm.{p}.") for p in packages)


def test_the_graph_sees_imports_inside_functions_and_from_package_imports():
    """The reader itself: a top-level, a lazy and a `from package import module` edge of known files."""
    assert "pagedllm.kv" in GRAPH["pagedllm.engine.llm_engine"]
    assert "pagedllm.entrypoints.llm" in GRAPH["pagedllm"]  # inside __getattr__
    assert "pagedllm.sampling_params" in GRAPH["pagedllm"]  # `from pagedllm import sampling_params`
    assert "pagedllm.bench.memory" in GRAPH["pagedllm.entrypoints.cli"]  # loaded by its name
    assert ("pagedllm.kv", "KVUsage") in imported_names("pagedllm.viz.figures")


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


def test_the_server_reaches_the_engine_only_through_async_engine():
    """Past AsyncEngine, whose every touch of the LLMEngine runs on the engine thread, no `x.engine.engine`:
    a route that needs the engine itself goes through AsyncEngine.run."""
    reads = sorted(
        f"{SOURCES[name].relative_to(ROOT.parent)}:{node.lineno}"
        for name, tree in TREES.items()
        if within(name, "entrypoints.openai") and name != "pagedllm.entrypoints.openai.async_engine"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "engine"
        and "engine" in (getattr(node.value, "attr", None), getattr(node.value, "id", None))
    )
    assert not reads, "\n".join(["the LLMEngine read past AsyncEngine:", *reads])


# The attention backends: ops/__init__'s registry is their one door (models call ops.X, whichever runs).
BACKEND_MODULES = (
    "pagedllm.ops.cpu",
    "pagedllm.ops.sdpa",
    "pagedllm.ops.reference",
    "pagedllm.ops.triton_ops",
)


def test_models_import_no_attention_backend():
    """A model reaches attention and its layer ops through `ops` only; the weight kernels it calls are the
    C++ library's (ops/native.py), which every backend on the CPU shares."""
    bad = sorted(
        f"{name} imports {module}"
        for name, modules in GRAPH.items()
        if within(name, "models")
        for module in modules
        if module in BACKEND_MODULES
    )
    assert not bad, "\n".join(["a backend imported by a model:", *bad])


def test_nothing_below_bench_viz_and_entrypoints_imports_them():
    """bench/, viz/ and entrypoints/ are the top: no floor below imports them (the package's own
    __init__ re-exports the entrypoints' LLM, its face); within them, viz never imports bench, and of
    the entrypoints only the CLI loads bench or viz."""
    top = ("bench", "viz", "entrypoints")
    bad = sorted(
        f"{name} imports {module}"
        for name, modules in GRAPH.items()
        for module in modules
        if (not within(name, *top) and name != "pagedllm" and within(module, *top))
        or (within(name, "viz") and within(module, "bench"))
        or (
            within(name, "entrypoints")
            and name != "pagedllm.entrypoints.cli"
            and within(module, "bench", "viz")
        )
    )
    assert not bad, "\n".join(["imported from below:", *bad])


# What bench/ and viz/ may import from the rest of pagedllm: module -> the names (None: any).
PUBLIC = {
    "pagedllm": None,  # LLM, SamplingParams, ...: the package's face
    "pagedllm.sampling_params": None,
    "pagedllm.outputs": None,
    "pagedllm.workload": None,  # the synthetic prompts bench and viz share
    "pagedllm.engine.config": None,  # EngineConfig and its constants: the settings a user passes
    "pagedllm.engine.stats": None,  # what stats() and the step observers give
    "pagedllm.engine.run_info": None,  # what run_info() gives
    "pagedllm.engine.op_profile": {"OpProfile"},  # what profile_ops() yields
    "pagedllm.kv": {"KVUsage", "USAGE_PARTS"},  # what stats().kv_usage holds
    # the model's files as a user names them: what the peers (HF, vLLM, llama.cpp) load too
    "pagedllm.models.loader": {"DEFAULT_MODEL", "resolve_checkpoint", "read_config", "gguf_file"},
}
# Component benchmarks that must replay the allocator or a kernel: (importer, imported module or package)
# -> why.
COMPONENTS = {
    ("pagedllm.bench.kernel", "pagedllm.ops"): "times the attention kernels themselves on synthetic caches",
    ("pagedllm.bench.kernel", "pagedllm.kv"): "each KV dtype's default block size, as the engine's",
    ("pagedllm.bench.kernel", "pagedllm.models"): "--decoder-layer: a layer in one call vs op by op",
    ("pagedllm.bench.gpu_check", "pagedllm.ops"): "checks the Triton kernels against the reference on a GPU",
    ("pagedllm.bench.linear", "pagedllm.models.linear"): "times the matmul kernels on the model's shapes",
    ("pagedllm.bench.linear", "pagedllm.models.quantization"): "times the int8 / int4 matmul kernels",
    ("pagedllm.bench.linear", "pagedllm.ops.native"): "names the kernels' build, or why it cannot be built",
    ("pagedllm.bench.memory", "pagedllm.kv"): "replays a trace through the allocators themselves (no model)",
    ("pagedllm.bench.sharing", "pagedllm.kv"): "replays parallel sampling's block sharing in the allocator",
    ("pagedllm.bench.sharing", "pagedllm.engine.beam_search"): "replays beam search's forks in the allocator",
    ("pagedllm.bench.kv_groups", "pagedllm.kv"): "the hybrid KV groups' allocator, without a forward pass",
    ("pagedllm.bench.kv_groups", "pagedllm.engine.scheduler"): "the real scheduler over that allocator",
    ("pagedllm.bench.kv_groups", "pagedllm.engine.sequence"): "the sequences that scheduler takes",
    ("pagedllm.bench.kv_groups", "pagedllm.engine.sampler"): "the samples it gets in place of a model's",
    ("pagedllm.bench.kv_groups", "pagedllm.engine.kv_sizing"): "block bytes and groups, as the engine's",
    ("pagedllm.bench.kv_groups", "pagedllm.models"): "the model's config (layers, windows): no weights",
    ("pagedllm.bench.quality", "pagedllm.models.attention"): "runs the engine's model for one long prefill",
    ("pagedllm.bench.quality", "pagedllm.ops"): "that prefill's cache, with the engine's key smoothing",
    ("pagedllm.bench.quality", "pagedllm.models.tokenizer"): "tokenizes the text whose perplexity it takes",
    ("pagedllm.bench.quality", "pagedllm.models.quantization"): "that prefill on the engine's GGUF path",
    ("pagedllm.bench.profile", "pagedllm.models.linear"): "the GEMM floor multiplies the model's weights",
    ("pagedllm.bench.throughput", "pagedllm.engine.kv_sizing"): "a TP run gets one process's KV blocks",
    ("pagedllm.bench.throughput", "pagedllm.engine.model_cache"): "holds the weights: the runs share a load",
    ("pagedllm.viz.report", "pagedllm.engine.model_cache"): "holds the weights: both runs share one load",
    ("pagedllm.bench.llama_cpp", "pagedllm.models.gguf_loader"): "llama.cpp's copies beside pagedllm's own",
    ("pagedllm.bench.serve", "pagedllm.entrypoints.openai.server"): "the server's own CPU step budget",
    ("pagedllm.bench.serve", "pagedllm.models.tokenizer"): "renders chat prompts for the load",
    ("pagedllm.bench.snapshot", "pagedllm.entrypoints.openai.dashboard"): "times what GET /v1/kv does",
    ("pagedllm.bench.snapshot", "pagedllm.entrypoints.openai.metrics"): "times the metrics it updates",
}


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def component(name: str, module: str) -> bool:
    """Whether COMPONENTS lets `name` import `module` (an entry names the module or a package above it)."""
    return any(a == name and under(module, b) for a, b in COMPONENTS)


def test_bench_and_viz_import_only_the_public_face_or_say_why():
    bad = sorted(
        f"{name} imports {module}" + (f".{what}" if what else "")
        for name in SOURCES
        if within(name, "bench", "viz")
        for module, what in imported_names(name)
        if not within(module, "bench", "viz")
        and not component(name, module)
        and not (module in PUBLIC and (PUBLIC[module] is None or what in PUBLIC[module]))
    )
    assert not bad, "\n".join(["past the engine's face, not in COMPONENTS:", *bad])


def test_every_component_entry_is_still_used():
    """An allow-list entry whose import is gone is removed with it."""
    stale = sorted(f"{a} -> {b}" for a, b in COMPONENTS if not any(under(m, b) for m in GRAPH.get(a, ())))
    assert not stale, stale


# The engine's face as bench/ and viz/ read it: `engine.X` (an LLMEngine, named engine or llm.engine).
FACE = {
    "add_request", "abort_request", "step", "has_unfinished_requests", "shutdown", "config",
    "add_step_observer", "remove_step_observer", "profile_ops", "stats", "kv_snapshot", "run_info",
    "unfinished_request_ids", "get_num_unfinished_requests", "layer_kv_caches", "comm_stats",
}  # fmt: skip
ENGINE_ATTRIBUTES = {  # (module, attribute) -> why a component benchmark reads it
    ("pagedllm.bench.profile", "model"): "the GEMM floor multiplies the model's own weight matrices",
    ("pagedllm.bench.quality", "model"): "one long prefill through the engine's model, for perplexity",
}


def engine_reads(name: str) -> set[str]:
    """The attributes `name` reads on an engine: `engine.X` or `<anything>.engine.X`."""
    reads = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "engine") or (
                isinstance(owner, ast.Attribute) and owner.attr == "engine"
            ):
                reads.add(node.attr)
    return reads


def test_bench_and_viz_read_only_the_engines_face():
    bad = sorted(
        f"{name} reads engine.{attr}"
        for name in SOURCES
        if within(name, "bench", "viz")
        for attr in engine_reads(name)
        if attr not in FACE and (name, attr) not in ENGINE_ATTRIBUTES
    )
    assert not bad, "\n".join(["engine attributes outside its face:", *bad])


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


def test_no_import_circle_anywhere():
    found = cycles(GRAPH)
    assert not found, "\n".join(["import cycles:", *(" -> ".join(cycle) for cycle in found)])


def _spans(kinds: tuple[type, ...], floors: tuple[str, ...]) -> list[tuple[str, int]]:
    """(qualified name, lines) of each function or class of these kinds in the modules of these floors."""
    spans = []
    for name, tree in TREES.items():
        if name.count(".") and name.split(".")[1] in floors:
            for node in ast.walk(tree):
                if isinstance(node, kinds):
                    spans.append((f"{name}.{node.name}", node.end_lineno - node.lineno + 1))
    return spans


def test_engine_and_kv_are_read_in_short_pieces():
    """Issue 46's shape, kept: no function in engine/ or kv/ over 60 lines, no class in kv/ over 400,
    llm_engine.py wiring plus the step loop (at most 350 lines)."""
    functions = _spans((ast.FunctionDef, ast.AsyncFunctionDef), ("engine", "kv"))
    assert len(functions) > 100 and [(f, n) for f, n in functions if n > 60] == []
    classes = _spans((ast.ClassDef,), ("kv",))
    assert len(classes) > 10 and [(c, n) for c, n in classes if n > 400] == []
    assert len(SOURCES["pagedllm.engine.llm_engine"].read_text().splitlines()) <= 350
