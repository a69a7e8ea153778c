"""The package's import graph, read from the source (function-level imports included): no import circles, and no
package or top-level module imports one on a layer above its own. LAYERS is the order; docs/ARCHITECTURE.md quotes
it, and a test holds the two equal."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pipeline"
ARCHITECTURE_PAGE = PACKAGE.parent / "docs" / "ARCHITECTURE.md"

# Every package ("name/") and top-level module of pipeline/, highest layer first. A unit imports only units on its
# own layer or below; one that imported upwards (the runtime importing the benchmark, the OpenAI proxy importing the
# Triton deployment, the pure accept rule importing a model loader) is the drift this stops.
LAYERS: list[tuple[str, ...]] = [
    ("__main__", "cli"),
    ("bench/", "distill/"),
    ("tinymodels", "trained_pair", "parity"),
    ("run_cmd",),
    ("triton/",),
    ("chat", "prompt_files"),
    ("stages",),
    ("executor/",),
    ("checks", "backends/"),
    ("models", "engine_info", "built_config", "gguf"),
    ("config", "artifacts", "yaml_loader", "quantize", "medusa_heads", "eagle3_heads"),
    ("openai_api/",),
    ("front/",),
    ("serving_contract", "tool_calls"),
    ("speculative/", "methods", "draft_vocab", "kv_settings", "layout", "dtypes", "decoder_support", "layer_math"),
    ("errors", "__init__"),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / Path(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in the file: lazy imports are edges too)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                targets = [f"{target}.{alias.name}" if _is_module(f"{target}.{alias.name}") else target
                           for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            edges.update(t for t in targets if t.split(".")[0] == "pipeline" and t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _unit(module: str) -> str:
    """The package or top-level module ``module`` belongs to, as LAYERS names it without the slash."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer_of() -> dict[str, int]:
    return {name.rstrip("/"): depth for depth, layer in enumerate(LAYERS) for name in layer}


def upward_imports(graph: dict[str, set[str]], layer_of: dict[str, int]) -> list[str]:
    """Every import from a unit to one on a higher layer (a smaller index in LAYERS)."""
    return sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                  if layer_of[_unit(target)] < layer_of[_unit(module)])


def _page_layers() -> list[tuple[str, ...]]:
    """The names on each layer of docs/ARCHITECTURE.md's layer block (its first fenced block): a line that starts
    at the left edge opens a layer, its names end at the first run of three spaces; indented lines continue the
    description."""
    block = re.search(r"^```\n(.*?)^```", ARCHITECTURE_PAGE.read_text(), re.S | re.M).group(1)
    return [tuple(re.split(r" {3,}", line.strip(), maxsplit=1)[0].split())
            for line in block.splitlines() if line.strip() and not line.startswith("  ")]


def test_no_import_circles():
    assert _cycles(import_graph()) == []


def test_every_package_and_module_has_one_layer():
    units = {path.stem for path in PACKAGE.glob("*.py")} | \
        {f"{path.parent.name}/" for path in PACKAGE.glob("*/__init__.py")}
    named = [name for layer in LAYERS for name in layer]
    assert sorted(named) == sorted(set(named)), "a name on two layers"
    assert set(named) == units, f"missing from LAYERS: {sorted(units - set(named))}; " \
                                f"not in pipeline/: {sorted(set(named) - units)}"


def test_no_import_runs_up_the_layers():
    wrong = upward_imports(import_graph(), _layer_of())
    assert wrong == [], "imports that run up the layers (see LAYERS and docs/ARCHITECTURE.md):\n" + "\n".join(wrong)


def test_the_architecture_page_quotes_the_layers():
    assert _page_layers() == LAYERS, "docs/ARCHITECTURE.md's layer block differs from LAYERS in this file"


def test_the_graph_sees_lazy_imports_and_circles():
    """The checks above are only as good as the graph: a function-level import is an edge, a circle is found."""
    graph = import_graph()
    assert "pipeline.executor.trtllm_executor" in graph["pipeline.executor.open"]  # imported lazily
    assert "pipeline.speculative.analytic" in graph["pipeline.executor.draft_policy"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    layers = {"stages": 0, "executor": 1, "errors": 2}
    assert upward_imports({"pipeline.executor.open": {"pipeline.stages", "pipeline.errors"},
                           "pipeline.errors": set(), "pipeline.stages": {"pipeline.executor.base"}}, layers) == \
        ["pipeline.executor.open -> pipeline.stages"]


MAX_FUNCTION_LINES = 60


def test_no_function_over_60_lines():
    """A function that does not fit a screen mixes concerns (parse, plan, run, report): split it by concern."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {lines} lines")
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)
