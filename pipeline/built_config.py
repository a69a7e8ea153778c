"""The part of a config that a role's engine is built from, and whether engines were built from a given config.

The build stage records :func:`role_config` of the resolved config in its manifest (``config``). Opening engines
compares a config with that record without resolving the models again: what the build derives from the models when
the config leaves it out (``build.max_seq_len``, ``build.max_input_len``, ``dtype: auto``) is taken as the build
recorded it, and every value the config states must equal the recorded one.
"""

from __future__ import annotations

from pathlib import Path

from .artifacts import completed_manifest, verify_outputs
from .config import PipelineConfig
from .errors import EngineError
from .layout import Layout

DERIVED_BUILD_LIMITS = ("max_seq_len", "max_input_len")  # None in a config: derived from the models at build time


def role_config(config: PipelineConfig, role: str) -> dict:
    """The part of the config a role's output depends on; the other role's settings must not invalidate it."""
    data = config.resolved()
    # Only what an engine is built for: the proposer (speculative.method, ngram) is chosen at run time, so swapping
    # it is a YAML edit that rebuilds nothing.
    speculative = {key: data["speculative"][key] for key in ("max_draft_len", "acceptance")}
    if role == "target" and config.has_medusa_heads:
        # Medusa heads are part of the target's engine (its convert takes them, its build verifies their tree).
        speculative["medusa"] = data["speculative"]["medusa"]
    if role == "target" and config.has_eagle3_heads:
        speculative["eagle3"] = data["speculative"]["eagle3"]  # the heads travel in the target's engine
    return {"name": config.name, "backend": config.backend, "model": data[role],
            "speculative": speculative, "build": data["build"]}


def check_built_from(config: PipelineConfig, root: Path) -> None:
    """Refuse the engines under ``root`` (engines/<name>) when one is missing, incomplete, modified since it was
    built (files deleted, truncated or edited: by size, and by hash for the small metadata files), or built from a
    config other than ``config``."""
    layout = Layout(Path(root))
    for role in config.roles:
        folder = layout.engine_dir(role)
        manifest = completed_manifest(folder, "build")
        verify_outputs(folder, manifest)  # before anything reads engine.json or the weights
        built_with = manifest.get("config", {})
        wanted = as_built(role_config(config, role), built_with)
        if built_with != wanted:
            field, old, new = first_difference(built_with, wanted)
            raise EngineError(f"{folder}: built from a different config ({role} {field}: {old!r} then, "
                              f"{new!r} now); rebuild with `python -m pipeline build CONFIG` or "
                              f"`make build-engines CONFIG=...`")


def as_built(wanted: dict, built_with: dict) -> dict:
    """``wanted`` (a role_config of a config as written) with the values the build derived filled in from
    ``built_with`` (the role_config its manifest recorded)."""
    filled = {**wanted, "build": dict(wanted["build"]), "model": dict(wanted["model"])}
    recorded_build, recorded_model = built_with.get("build") or {}, built_with.get("model") or {}
    for key in DERIVED_BUILD_LIMITS:
        if filled["build"].get(key) is None and key in recorded_build:
            filled["build"][key] = recorded_build[key]
    if filled["model"].get("dtype") == "auto" and "dtype" in recorded_model:
        filled["model"]["dtype"] = recorded_model["dtype"]
    return filled


def first_difference(old: object, new: object, prefix: str = "") -> tuple[str, object, object]:
    """The dotted path of the first key (in sorted order) where ``old`` and ``new`` differ, with both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                return first_difference(old.get(key), new.get(key), f"{prefix}.{key}" if prefix else key)
    return prefix or "<root>", old, new
