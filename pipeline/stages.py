"""check, convert and build for the config's roles (the target, and the draft when speculative.method drafts with a
model), each output under engines/<name>/<role>/<stage>/ with a manifest.

A later stage reads the earlier stage's manifest (never the user's YAML again) and keys its own output on that
manifest's input key, so editing the config or the source model invalidates exactly what depends on it. What part of
the config a role's output depends on is built_config.role_config; opening the engines (pipeline.executor.open)
checks a config against it without this module.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .artifacts import StageResult, build_lock, completed_manifest, content_hashes, run_stage
from .backends import get_backend
from .built_config import check_built_from, role_config
from .checks import CheckReport, check_pair, with_resolved_defaults
from .config import PipelineConfig
from .dtypes import torch_device
from .engine_info import read_engine
from .layout import Layout
from .models import resolve_model, weight_files


def run_check(config: PipelineConfig, with_weights: bool = False) -> CheckReport:
    report = check_pair(config, with_weights=with_weights)
    for line in report.ok:
        print(f"  ok       {line}")
    for line in report.defaults:
        print(f"  default  {line}")
    for line in report.warnings:
        print(f"  warning  {line}", file=sys.stderr)
    report.raise_if_failed()
    return report


def convert_role(config: PipelineConfig, layout: Layout, role: str, force: bool = False,
                 verify: bool = False) -> StageResult:
    model = resolve_model(getattr(config, role), role, config.base_dir, with_weights=True)
    weight_files(model)  # refuses pickle-only folders before anything is hashed or loaded
    # A GGUF source is its file: the dequantized folder is derived from it (and cached under its hash).
    files = {model.gguf_file.name: model.gguf_sha256} if model.gguf_file else content_hashes(model.path)
    inputs = {"model_files": files, "revision": model.revision}
    if role == "target" and config.has_medusa_heads:
        inputs["medusa_files"] = content_hashes(config.medusa_dir())
    if role == "target" and config.has_eagle3_heads:
        inputs["eagle3_files"] = content_hashes(config.eagle3_dir())
    backend = get_backend(config.backend)
    role_cfg = role_config(config, role)
    speculative = role_cfg.pop("speculative")  # a conversion does not depend on K
    for heads in ("medusa", "eagle3"):
        if speculative.get(heads) is not None:
            role_cfg[heads] = speculative[heads]
    return run_stage("convert", role, layout.stage_dir(role, "convert"), inputs, role_cfg,
                     lambda tmp: backend.convert(config, role, model, tmp), force=force, verify=verify)


def build_role(config: PipelineConfig, layout: Layout, role: str, force: bool = False,
               dry_run: bool = False, verify: bool = False) -> StageResult | list[str]:
    config = with_resolved_defaults(config)  # argv and engine.json need numbers and dtypes (no-op when resolved)
    backend = get_backend(config.backend)
    checkpoint_dir = layout.stage_dir(role, "convert")
    out_dir = layout.stage_dir(role, "build")
    if dry_run:
        return backend.build_plan(config, role, checkpoint_dir, out_dir)
    convert_manifest = completed_manifest(layout.stage_dir(role, "convert"), "convert")
    inputs = {"convert_key": convert_manifest["input_key"], "convert_outputs": convert_manifest["outputs"]}
    return run_stage("build", role, out_dir, inputs, role_config(config, role),
                     lambda tmp: backend.build(config, role, checkpoint_dir, tmp), force=force, verify=verify)


def verify_engines(config: PipelineConfig, engines_dir: Path) -> Layout:
    """Refuse engines that are missing, incomplete, modified since they were built, or built from a config other
    than this one (see built_config.check_built_from: the models are not read again)."""
    layout = Layout.for_config(config, engines_dir)
    check_built_from(config, layout.root)
    return layout


def run_stages(config: PipelineConfig, engines_dir: Path, stages: tuple[str, ...], force: bool = False,
               verify: bool = False) -> list[StageResult]:
    """Run convert and/or build for the config's roles under its build lock, printing each stage's progress.

    The pair is checked first (tokenizers, limits, weight headers), so a bad input fails before anything is
    written under engines/. A stage is "up to date" only when its outputs still match its manifest (sizes and
    mtimes; every file's hash with ``verify``); otherwise it is redone.
    """
    if "convert" in stages:
        print(f"check {config.name} ({config.backend} backend)")
        config = run_check(config, with_weights=True).resolved(config)
    else:
        config = with_resolved_defaults(config)
    layout = Layout.for_config(config, engines_dir)
    results: list[StageResult] = []
    with build_lock(layout.root):
        for stage in stages:
            for role in config.roles:
                print(f"[{stage}] {role}: {getattr(config, role).model}", file=sys.stderr, flush=True)
                step = convert_role if stage == "convert" else build_role
                result = step(config, layout, role, force=force, verify=verify)
                print(f"[{stage}] {role}: {result.status} ({result.seconds:.1f}s) -> {result.path}",
                      file=sys.stderr, flush=True)
                results.append(result)
        if "build" in stages:
            _ready_row_kernels(config, layout)
    return results


def _ready_row_kernels(config: PipelineConfig, layout: Layout) -> None:
    """A torch engine on the lean decoder runs on a CPU through the row kernels' C++ library
    (executor/row_kernels.py): build it now (about 40 s on 2 cores, once per machine and source, kept in the cache
    folder) rather than at the engine's first start. A CPU it cannot run on is said, not an error."""
    if config.backend != "torch" or torch_device(config.runtime.device) != "cpu":
        return
    if any(read_engine(layout.root, role).runner == "lean" for role in config.roles):
        from .executor import row_kernels

        print(f"row kernels: {row_kernels.unavailable() or row_kernels.state()}", file=sys.stderr, flush=True)


def summary(results: list[StageResult]) -> str:
    lines = [f"{'stage':8} {'role':7} {'status':11} {'seconds':>8}  path"]
    for r in results:
        lines.append(f"{r.stage:8} {r.role:7} {r.status:11} {r.seconds:8.1f}  {r.path}")
    return "\n".join(lines)
