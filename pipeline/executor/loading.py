"""Read engine folders (engine.json + manifest) and load torch-backend engines as HF models."""

from __future__ import annotations

import json
from pathlib import Path

from ..artifacts import read_manifest
from ..config import ModelSpec
from ..errors import EngineError
from ..models import ResolvedModel, load_causal_lm

ENGINE_FILE = "engine.json"  # written by every backend's build beside its engine files


def load_engine_model(folder: Path, info: dict):
    """Returns (model, ResolvedModel of the folder). The engine folder always holds safetensors weights."""
    spec = ModelSpec(model=str(folder), dtype=info["dtype"])
    resolved = ResolvedModel(info["role"], spec, folder, "local", None)
    return load_causal_lm(resolved, info["dtype"]), resolved


def read_engine_info(root: Path, role: str) -> dict:
    """engine.json of engines/<name>/<role>/build, which must be a completed stage (either backend)."""
    folder = root / role / "build"
    manifest = read_manifest(folder) if folder.exists() else None
    if manifest is None:
        raise EngineError(f"{folder}: no completed engine; run `python -m pipeline build CONFIG` (or `make "
                          f"build-engines`) first")
    engine_file = folder / ENGINE_FILE
    if not engine_file.is_file():
        raise EngineError(f"{engine_file}: missing; the engine folder is incomplete, rebuild it with --force")
    return json.loads(engine_file.read_text())
