"""Backends turn a resolved HF model into a backend checkpoint (convert) and an engine (build).

Each backend module exposes:
  convert(config, role, model: ResolvedModel, out_dir) -> dict   facts for the manifest
  build(config, role, checkpoint_dir, out_dir) -> dict           facts for the manifest (argv, limits, engine.json)
  build_plan(config, role, checkpoint_dir, out_dir) -> list[str] what build would run, for --dry-run
and may expose
  convert_plan(config, role, out_dir) -> list[str]               what convert would run, for --dry-run (trtllm)
The trtllm module is imported only when selected: TensorRT-LLM is absent on most machines. The backends' runtimes
are in pipeline/executor/ (open_executor picks one by the backend engine.json names).
"""

from __future__ import annotations

from types import ModuleType


def get_backend(name: str) -> ModuleType:
    if name == "torch":
        from . import torch_backend

        return torch_backend
    if name == "trtllm":
        from . import trtllm

        return trtllm
    raise ValueError(f"backend: {name!r} is unknown; use torch or trtllm")
