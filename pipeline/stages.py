"""check, convert and build for the config's roles (the target, and the draft unless speculative.method is ngram),
each output under engines/<name>/<role>/<stage>/ with a manifest.

A later stage reads the earlier stage's manifest (never the user's YAML again) and keys its own output on that
manifest's input key, so editing the config or the source model invalidates exactly what depends on it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .artifacts import StageResult, build_lock, content_hashes, read_manifest, run_stage, verify_outputs
from .backends import get_backend
from .checks import CheckReport, check_pair, with_resolved_defaults
from .config import PipelineConfig
from .errors import EngineError
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


def _role_config(config: PipelineConfig, role: str) -> dict:
    """The part of the config a role's output depends on; the other role's settings must not invalidate it."""
    data = config.resolved()
    # Only what an engine is built for: the proposer (speculative.method, ngram) is chosen at run time, so swapping
    # it is a YAML edit that rebuilds nothing.
    speculative = {key: data["speculative"][key] for key in ("max_draft_len", "acceptance")}
    if role == "target" and config.has_medusa_heads:
        # Medusa heads are part of the target's engine (its convert takes them, its build verifies their tree).
        speculative["medusa"] = data["speculative"]["medusa"]
    return {"name": config.name, "backend": config.backend, "model": data[role],
            "speculative": speculative, "build": data["build"]}


def convert_role(config: PipelineConfig, layout: Layout, role: str, force: bool = False,
                 verify: bool = False) -> StageResult:
    model = resolve_model(getattr(config, role), role, config.base_dir, with_weights=True)
    weight_files(model)  # refuses pickle-only folders before anything is hashed or loaded
    # A GGUF source is its file: the dequantized folder is derived from it (and cached under its hash).
    files = {model.gguf_file.name: model.gguf_sha256} if model.gguf_file else content_hashes(model.path)
    inputs = {"model_files": files, "revision": model.revision}
    if role == "target" and config.has_medusa_heads:
        inputs["medusa_files"] = content_hashes(config.medusa_dir())
    backend = get_backend(config.backend)
    role_cfg = _role_config(config, role)
    medusa = role_cfg.pop("speculative").get("medusa")  # a conversion does not depend on K
    if medusa is not None:
        role_cfg["medusa"] = medusa
    return run_stage("convert", role, layout.stage_dir(role, "convert"), inputs, role_cfg,
                     lambda tmp: backend.convert(config, role, model, tmp), force=force, verify=verify)


def _completed(layout: Layout, role: str, stage: str) -> dict:
    folder = layout.stage_dir(role, stage)
    manifest = read_manifest(folder) if folder.exists() else None
    if manifest is None:
        raise EngineError(f"{folder}: no completed {stage} output; run `python -m pipeline {stage} CONFIG` first")
    return manifest


def build_role(config: PipelineConfig, layout: Layout, role: str, force: bool = False,
               dry_run: bool = False, verify: bool = False) -> StageResult | list[str]:
    config = with_resolved_defaults(config)  # argv and engine.json need numbers and dtypes (no-op when resolved)
    backend = get_backend(config.backend)
    checkpoint_dir = layout.stage_dir(role, "convert")
    out_dir = layout.stage_dir(role, "build")
    if dry_run:
        return backend.build_plan(config, role, checkpoint_dir, out_dir)
    convert_manifest = _completed(layout, role, "convert")
    inputs = {"convert_key": convert_manifest["input_key"], "convert_outputs": convert_manifest["outputs"]}
    return run_stage("build", role, out_dir, inputs, _role_config(config, role),
                     lambda tmp: backend.build(config, role, checkpoint_dir, tmp), force=force, verify=verify)


def verify_engines(config: PipelineConfig, engines_dir: Path) -> Layout:
    """Refuse engines that are missing, incomplete, modified since they were built (files deleted, truncated or
    edited: checked by size, and by hash for the small metadata files), or built from a config other than this
    one."""
    layout = Layout.for_config(config, engines_dir)
    config = with_resolved_defaults(config)  # the build manifests hold the limits and dtypes built with
    for role in config.roles:
        folder = layout.stage_dir(role, "build")
        manifest = _completed(layout, role, "build")
        verify_outputs(folder, manifest)  # before anything reads engine.json or the weights
        built_with, wanted = manifest.get("config", {}), _role_config(config, role)
        if built_with != wanted:
            field, old, new = _first_difference(built_with, wanted)
            raise EngineError(f"{folder}: built from a different config ({role} {field}: {old!r} then, "
                              f"{new!r} now); rebuild with `python -m pipeline build CONFIG` or "
                              f"`make build-engines CONFIG=...`")
    return layout


def _first_difference(old: object, new: object, prefix: str = "") -> tuple[str, object, object]:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                return _first_difference(old.get(key), new.get(key), f"{prefix}.{key}" if prefix else key)
    return prefix or "<root>", old, new


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
    return results


def summary(results: list[StageResult]) -> str:
    lines = [f"{'stage':8} {'role':7} {'status':11} {'seconds':>8}  path"]
    for r in results:
        lines.append(f"{r.stage:8} {r.role:7} {r.status:11} {r.seconds:8.1f}  {r.path}")
    return "\n".join(lines)
