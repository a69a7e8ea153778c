"""Load a torch-backend engine folder (weights in the build dtype + engine.json) as an HF model."""

from __future__ import annotations

from pathlib import Path

from ..config import ModelSpec
from ..models import ResolvedModel, load_causal_lm


def load_engine_model(folder: Path, info: dict):
    """Returns (model, ResolvedModel of the folder). The engine folder always holds safetensors weights."""
    spec = ModelSpec(model=str(folder), dtype=info["dtype"])
    resolved = ResolvedModel(info["role"], spec, folder, "local", None)
    return load_causal_lm(resolved, info["dtype"]), resolved
