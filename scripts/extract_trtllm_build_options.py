"""Extract the `trtllm-build` option list (names, aliases, types, choices, defaults) from TensorRT-LLM sources.

Reads the source text with Python's ast, never imports it, so it runs on any machine: on a GPU box point it at the
installed release (`python -c "import tensorrt_llm.commands.build as b; print(b.__file__)"`) to diff it against
the recorded tests/data/trtllm_<release>_api.json.

    python scripts/extract_trtllm_build_options.py BUILD_PY PLUGIN_PY [--provenance KEY=VALUE ...]

build.py: every `<parser>.add_argument(...)` call inside `parse_arguments()`.
plugin.py: `add_plugin_argument()` turns each field of `PluginConfig` named in `cli_plugin_args` into an option;
this script applies the same rules to the field annotations (Literal choices with None spelled "disable", booleans
as enable/disable, anything else typed by its annotation). Values that are expressions in the source (such as
`BuildConfig.max_batch_size` or `severity_map.keys()`) are recorded as their source text under `*_expr`.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path


def _literal(node: ast.AST):
    """(value, True) for a literal, else (source text, False)."""
    try:
        return ast.literal_eval(node), True
    except ValueError:
        return ast.unparse(node), False


def _put(spec: dict, key: str, node: ast.AST) -> None:
    value, is_literal = _literal(node)
    spec[key if is_literal else f"{key}_expr"] = value


def build_options(source: str) -> dict[str, dict]:
    tree = ast.parse(source)
    func = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "parse_arguments"), None)
    if func is None:
        raise SystemExit("build.py: no parse_arguments() function found")
    options: dict[str, dict] = {}
    for call in ast.walk(func):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "add_argument"):
            continue
        names = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        spec: dict = {}
        for kw in call.keywords:
            if kw.arg == "help":
                continue
            if kw.arg == "type":
                spec["type"] = ast.unparse(kw.value)  # "str", "int", "enum_type(KVCacheType)"
            elif kw.arg in ("choices", "default", "nargs", "action", "dest"):
                _put(spec, kw.arg, kw.value)
        if len(names) > 1:
            spec["aliases"] = names[1:]
        options[names[0]] = spec
    return options


def _module_assignments(tree: ast.Module) -> dict[str, ast.AST]:
    return {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name)}


def _choices(annotation: ast.AST, aliases: dict[str, ast.AST]) -> list | None:
    """Literal[...] choices inside Optional[...] (None appended, as get_args on the Optional gives NoneType)."""
    if isinstance(annotation, ast.Name) and annotation.id in aliases:
        return _choices(aliases[annotation.id], aliases)
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "Optional":
        inner = _choices(annotation.slice, aliases)
        return None if inner is None else [*inner, None]
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "Literal":
        elements = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
        return [ast.literal_eval(e) for e in elements]
    return None


def plugin_options(source: str) -> dict[str, dict]:
    tree = ast.parse(source)
    aliases = _module_assignments(tree)
    cli_args = ast.literal_eval(aliases["cli_plugin_args"])
    config = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PluginConfig")
    options: dict[str, dict] = {}
    for field in config.body:
        if not (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)):
            continue
        name = field.target.id
        if name not in cli_args:
            continue
        default = None
        if isinstance(field.value, ast.Call):
            for kw in field.value.keywords:
                if kw.arg == "default":
                    default = ast.literal_eval(kw.value)
        choices = _choices(field.annotation, aliases)
        if choices is not None:
            unique = list(dict.fromkeys("disable" if c is None else c for c in choices))
            shown = default if name == "gemm_plugin" else (default if default else "disable")
            options[f"--{name}"] = {"type": "str", "choices": unique, "default": shown}
        elif ast.unparse(field.annotation) == "bool":
            options[f"--{name}"] = {"type": "str", "choices": ["enable", "disable"],
                                    "default": "enable" if default else "disable"}
        else:
            options[f"--{name}"] = {"type": ast.unparse(field.annotation), "default": default}
    missing = [a for a in cli_args if f"--{a}" not in options]
    if missing:
        raise SystemExit(f"plugin.py: cli_plugin_args names fields PluginConfig does not declare: {missing}")
    return options


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build_py", type=Path)
    parser.add_argument("plugin_py", type=Path)
    parser.add_argument("--provenance", action="append", default=[], metavar="KEY=VALUE",
                        help="recorded as-is under 'provenance' (repository, commits, ...)")
    args = parser.parse_args(argv)
    options = build_options(args.build_py.read_text())
    plugins = plugin_options(args.plugin_py.read_text())
    clash = sorted(set(options) & set(plugins))
    if clash:
        raise SystemExit(f"options declared by both build.py and plugin.py: {clash}")
    result = {"provenance": dict(p.split("=", 1) for p in args.provenance),
              "options": {**options, **plugins}}
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
