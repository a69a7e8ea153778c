"""Run functions of recorded upstream files (tests/data) without their imports: the named function definitions are
taken from the file's syntax tree as upstream wrote them and executed in a namespace the test provides (the stdlib
modules and FAKE stand-ins for what the file imports), so a test checks our output with upstream's own code rather
than with a retyped copy of it."""

from __future__ import annotations

import ast
from pathlib import Path

MEDUSA_DATA = Path(__file__).resolve().parent / "data" / "trtllm_1.1.0_medusa"
MEDUSA_CONVERTER = MEDUSA_DATA / "examples" / "medusa" / "convert_checkpoint.py"
TRITON_LLM_MODEL = (MEDUSA_DATA / "triton_backend" / "all_models" / "inflight_batcher_llm" / "tensorrt_llm" / "1"
                    / "model.py")


def function_defs(path: Path) -> dict[str, list[ast.FunctionDef]]:
    """Every function defined in ``path``, at top level or as a class method, by name (a method as its bare name)."""
    found: dict[str, list[ast.FunctionDef]] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.FunctionDef):
            found.setdefault(node.name, []).append(node)
    return found


def load_functions(path: Path, names: list[str], namespace: dict) -> dict:
    """Define the functions ``names`` of ``path`` in ``namespace`` (which supplies their globals); returns it."""
    defs = function_defs(path)
    for name in names:
        assert len(defs.get(name, [])) == 1, f"{path}: {len(defs.get(name, []))} functions named {name}, not one"
    module = ast.Module(body=[defs[name][0] for name in names], type_ignores=[])
    exec(compile(module, str(path), "exec"), namespace)  # noqa: S102 - a recorded upstream file, read as data
    return namespace
