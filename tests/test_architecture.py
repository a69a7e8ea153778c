"""The package's import graph, read from the source (function-level imports included): no import circles, and no
layer imports one above it. docs/ARCHITECTURE.md states the same rules in words; change both together."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pipeline"

# Who may not import whom: package (or top-level module) -> the ones above it. A runtime that imported the benchmark
# or the server, or a pure accept rule that imported a model loader, is the drift these rules stop.
FORBIDDEN = {
    "speculative": {"*"},  # pure tensor code: imports nothing else of the package
    "methods": {"*"},
    "errors": {"*"},
    "draft_vocab": {"*"},  # model-level tensor code: executor, distill and checks read it
    # Medusa heads share draft_vocab's layer and its token-id check; nothing else of the package.
    "medusa_heads": {"executor", "backends", "bench", "triton", "cli", "run_cmd", "stages", "checks", "models",
                     "engine_info", "gguf", "config", "artifacts", "yaml_loader", "distill", "chat", "prompt_files",
                     "speculative", "methods", "errors", "layout", "dtypes", "parity", "tinymodels", "trained_pair"},
    # int8 layers: model-level tensor code beside draft_vocab; reads only config's list of modes.
    "quantize": {"executor", "backends", "bench", "triton", "cli", "run_cmd", "stages", "checks", "models",
                 "engine_info", "gguf", "distill", "chat", "prompt_files"},
    "executor": {"bench", "triton", "cli", "run_cmd", "stages", "chat", "prompt_files"},
    "backends": {"executor", "bench", "triton", "cli", "run_cmd", "stages"},
    "engine_info": {"executor", "backends", "bench", "triton", "cli", "run_cmd", "stages"},
    "config": {"executor", "backends", "bench", "triton", "cli", "run_cmd", "stages", "checks", "models"},
    "checks": {"executor", "bench", "triton", "cli", "run_cmd", "stages"},
    "triton": {"bench", "cli", "run_cmd"},
    # The HTTP/gRPC fronts (host and key checks, limits, drain) know no model, no config and no server of ours.
    "front": {"executor", "backends", "models", "stages", "bench", "distill", "run_cmd", "cli", "triton", "openai_api",
              "config", "checks", "engine_info", "speculative", "methods", "chat", "prompt_files", "artifacts"},
    # The OpenAI endpoint is a proxy in front of Triton: it never loads a model or runs the engine itself.
    "openai_api": {"executor", "backends", "models", "stages", "bench", "distill", "run_cmd", "cli"},
    "stages": {"bench", "triton", "cli", "run_cmd"},
    "run_cmd": {"bench", "triton", "cli"},
    "distill": {"bench", "triton", "cli", "run_cmd"},
}


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


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_circles():
    assert _cycles(import_graph()) == []


def test_no_layer_imports_one_above_it():
    wrong = []
    for module, targets in import_graph().items():
        banned = FORBIDDEN.get(_layer(module), set())
        for target in targets:
            if _layer(target) != _layer(module) and ("*" in banned or _layer(target) in banned):
                wrong.append(f"{module} -> {target}")
    assert wrong == [], "imports that run up the layers (see docs/ARCHITECTURE.md):\n" + "\n".join(sorted(wrong))


def test_the_graph_sees_lazy_imports_and_circles():
    """The checks above are only as good as the graph: a function-level import is an edge, a circle is found."""
    graph = import_graph()
    assert "pipeline.executor.trtllm_executor" in graph["pipeline.executor.speculative_executor"]  # imported lazily
    assert "pipeline.speculative.analytic" in graph["pipeline.executor.draft_policy"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
