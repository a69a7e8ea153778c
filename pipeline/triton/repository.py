"""``deploy``: write ``engines/<name>/triton/``, the model repository for the config's backend.

Written like every stage: into a temp folder that is renamed on success, with a manifest whose key covers the
inputs (engine manifests, the Python model file, the config, the absolute paths baked into config.pbtxt), so an
unchanged deployment is "up to date" and a killed one never looks complete.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..layout import Layout
from ..artifacts import StageResult, read_manifest, run_stage, sha256_file
from ..config import PipelineConfig
from ..errors import ConfigError, EngineError
from ..methods import Method
from . import torch_repo, trtllm_repo


@dataclass(frozen=True)
class DeployPlan:
    config: PipelineConfig
    engines_root: Path  # absolute engines/<name>

    @classmethod
    def for_config(cls, config: PipelineConfig, engines_dir: Path) -> DeployPlan:
        return cls(config, (Path(engines_dir) / config.name).resolve())

    @property
    def repo(self) -> Path:
        return self.engines_root / "triton"

    def engine_dir(self, role: str) -> Path:
        return Layout(self.engines_root).engine_dir(role)


def _engine_keys(plan: DeployPlan) -> dict[str, str]:
    keys = {}
    for role in plan.config.roles:
        folder = plan.engine_dir(role)
        manifest = read_manifest(folder) if folder.exists() else None
        if manifest is None:
            raise EngineError(f"{folder}: no completed {role} engine to deploy; run `python -m pipeline build "
                              f"{plan.config.name}.yaml` (or `make build-engines`) first")
        keys[role] = manifest["input_key"]
    return keys


def deploy(config: PipelineConfig, engines_dir: Path, force: bool = False,
           tokenizer_dir: str | None = None) -> StageResult:
    from ..checks import with_resolved_defaults

    config = with_resolved_defaults(config)  # the manifest records the limits and dtypes built with
    plan = DeployPlan.for_config(config, engines_dir)
    if config.backend == "torch":
        inputs = {"engines": _engine_keys(plan), "model_py": sha256_file(torch_repo.MODEL_FILE),
                  "model_configs": torch_repo.configs_digest(config, plan.engines_root),
                  "engines_root": str(plan.engines_root), "pipeline_root": str(torch_repo.PIPELINE_ROOT)}

        def produce(tmp: Path) -> dict:
            written = torch_repo.write_torch_repository(tmp, config, plan.engines_root)
            return {"models": [p.name for p in written]}
    else:
        if config.speculative.method in (Method.NGRAM, Method.SUFFIX):
            method = config.speculative.method.value
            raise ConfigError(f"speculative.method: {method!r} cannot be served by the tensorrtllm_backend layout, "
                              f"whose tensorrt_llm_bls drafts with a draft engine; run {method} on TensorRT-LLM "
                              f"through the Python executor (`python -m pipeline run`), or use backend: torch to "
                              f"serve it with Triton, or method draft_model")
        # TensorRT-LLM engines are built on the GPU box; the repository only names their paths, so it can be
        # generated (and checked) anywhere.
        paths = trtllm_repo.TrtllmPaths.for_engines(plan.engine_dir("target"), plan.engine_dir("draft"),
                                                    tokenizer_dir)
        vocab = trtllm_repo.EngineVocab.read(paths)
        inputs = trtllm_repo.stage_inputs(paths, vocab)

        def produce(tmp: Path) -> dict:
            written = trtllm_repo.write_trtllm_repository(tmp, config, paths, plan.repo, vocab)
            return {"models": [p.name for p in written],
                    "launch_command": trtllm_repo.launch_command(config, plan.repo,
                                                                  trtllm_repo.DISPLAY_LAUNCHER)}
    return run_stage("deploy", "triton", plan.repo, inputs, _repository_settings(config), produce, force=force)


def _repository_settings(config: PipelineConfig) -> dict:
    """The config as the repository depends on it: where the server listens is a serve-time choice."""
    data = config.resolved()
    for key in ("bind_address", "http_port", "grpc_port", "metrics_port", "openai_port", "api_key_env",
                "allowed_hosts", "allowed_origins", "max_connections", "read_timeout_s", "drain_timeout_s"):
        data["serve"].pop(key, None)
    return data
