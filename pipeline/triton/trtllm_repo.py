"""The tensorrtllm_backend model repository for TensorRT-LLM engines (the production GPU path).

Six models, each config.pbtxt written whole from the pipeline config:

- ``tensorrt_llm``        C++ ``tensorrtllm`` backend on the TARGET engine (verifies draft tokens in-engine)
- ``tensorrt_llm_draft``  the same backend on the DRAFT engine
- ``tensorrt_llm_bls``    Python BLS model: preprocess, draft K tokens, verify on the target, postprocess
- ``preprocessing`` / ``postprocessing``  tokenizer in / out (Python)
- ``ensemble``            preprocessing -> tensorrt_llm -> postprocessing (target only, no drafting)

The three Python models run the upstream ``model.py`` files of the pinned TensorRT-LLM release (they are not
copied into this project); ``launch.sh`` copies them from the release checkout in the container into the version
folders before starting the server. Their config.pbtxt declare exactly the tensors those files look up by name.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from ..config import PipelineConfig
from . import trtllm_tensors as T
from .pbtxt import cpu_instances, set_parameters, tensor_in, tensor_out, write_model

TARGET, DRAFT, BLS, ENSEMBLE = "tensorrt_llm", "tensorrt_llm_draft", "tensorrt_llm_bls", "ensemble"
PREPROCESSING, POSTPROCESSING = "preprocessing", "postprocessing"
UPSTREAM_PYTHON_MODELS = (PREPROCESSING, POSTPROCESSING, BLS)
TRTLLM_RELEASE = "1.2.1"
CONTAINER = "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"
DISPLAY_LAUNCHER = "scripts/launch_triton_server.py"  # relative to TensorRT-LLM's triton_backend/ folder


@dataclass(frozen=True)
class TrtllmPaths:
    """Absolute paths the generated configs point at (inside the serving container they must exist as-is)."""

    target_engine: Path  # <engines>/<name>/target/build
    draft_engine: Path  # <engines>/<name>/draft/build
    tokenizer_dir: str  # local folder, or a hub id that AutoTokenizer can resolve


@dataclass(frozen=True)
class RankPlan:
    """MPI layout for two TensorRT-LLM models in one server (orchestrator mode, processes not spawned).

    Rank 0 is the Triton orchestrator; the target takes ranks 1..tp*pp and the draft (TP=1) the next rank.
    """

    target_ranks: list[int]
    draft_ranks: list[int]

    @classmethod
    def for_config(cls, config: PipelineConfig) -> RankPlan:
        n = config.build.parallel.world_size
        return cls(list(range(1, n + 1)), [n + 1])

    @property
    def world_size(self) -> int:
        return 1 + len(self.target_ranks) + len(self.draft_ranks)


def _add(rows: list[T.Row], config: mc.ModelConfig, outputs: bool = False) -> None:
    for name, dtype, dims, flags in rows:
        if outputs:
            config.output.append(tensor_out(name, dtype, dims))
        else:
            config.input.append(tensor_in(name, dtype, dims, optional="o" in flags, ragged="r" in flags,
                                          reshape=[] if "s" in flags else None))


def _ids(values: list[int]) -> str:
    return ",".join(str(v) for v in values)


def tensorrt_llm_config(config: PipelineConfig, name: str, engine_dir: Path, device_ids: list[int],
                        participant_ids: list[int]) -> mc.ModelConfig:
    kv = config.build.kv_cache
    model = mc.ModelConfig(name=name, backend="tensorrtllm", max_batch_size=config.build.max_batch_size)
    # Speculative decoding through the BLS is request/response only (upstream: no streaming with a draft model).
    model.model_transaction_policy.decoupled = False
    model.dynamic_batching.preferred_batch_size.append(config.build.max_batch_size)
    model.dynamic_batching.max_queue_delay_microseconds = config.serve.max_queue_delay_us
    _add(T.TENSORRT_LLM_INPUTS, model)
    _add(T.TENSORRT_LLM_OUTPUTS, model, outputs=True)
    model.instance_group.append(cpu_instances(1))  # the C++ backend owns its GPUs via gpu_device_ids
    set_parameters(model, {
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": engine_dir,
        "max_beam_width": 1,  # draft_tokens_external supports beam width 1 only
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "batch_scheduler_policy": "guaranteed_no_evict",
        "kv_cache_free_gpu_mem_fraction": kv.free_gpu_mem_fraction,
        "enable_kv_cache_reuse": kv.enable_block_reuse,
        "enable_chunked_context": False,
        "exclude_input_in_output": False,
        "normalize_log_probs": True,
        "gpu_device_ids": _ids(device_ids),
        "participant_ids": _ids(participant_ids),
        # Sampling decoder; the external-draft-tokens path is switched on per request by draft_input_ids.
        "decoding_mode": "top_k_top_p",
        # Draft logits go GPU to GPU between the two executors; needs the orchestrator rank layout above.
        "speculative_decoding_fast_logits": config.speculative.acceptance == "rejection",
        "executor_worker_path": "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker",
    })
    return model


def preprocessing_config(config: PipelineConfig, paths: TrtllmPaths) -> mc.ModelConfig:
    model = mc.ModelConfig(name=PREPROCESSING, backend="python", max_batch_size=config.build.max_batch_size)
    model.dynamic_batching.max_queue_delay_microseconds = config.serve.max_queue_delay_us
    _add(T.PREPROCESSING_INPUTS, model)
    _add(T.PREPROCESSING_OUTPUTS, model, outputs=True)
    model.instance_group.append(cpu_instances(config.serve.instances))
    set_parameters(model, {"tokenizer_dir": paths.tokenizer_dir, "add_special_tokens": True,
                           "multimodal_model_path": "", "gpt_model_path": paths.target_engine})
    return model


def postprocessing_config(config: PipelineConfig, paths: TrtllmPaths) -> mc.ModelConfig:
    model = mc.ModelConfig(name=POSTPROCESSING, backend="python", max_batch_size=config.build.max_batch_size)
    model.dynamic_batching.SetInParent()
    _add(T.POSTPROCESSING_INPUTS, model)
    _add(T.POSTPROCESSING_OUTPUTS, model, outputs=True)
    model.instance_group.append(cpu_instances(config.serve.instances))
    set_parameters(model, {"tokenizer_dir": paths.tokenizer_dir, "skip_special_tokens": True})
    return model


def bls_config(config: PipelineConfig) -> mc.ModelConfig:
    model = mc.ModelConfig(name=BLS, backend="python", max_batch_size=config.build.max_batch_size)
    model.model_transaction_policy.decoupled = False
    _add(T.BLS_INPUTS, model)
    _add(T.TEXT_OUTPUTS, model, outputs=True)
    # One BLS instance serves one request at a time (upstream: batch 1 with a draft model), so concurrency
    # comes from instances; upstream suggests about the engine's max batch size.
    model.instance_group.append(cpu_instances(config.build.max_batch_size))
    set_parameters(model, {"accumulate_tokens": False, "tensorrt_llm_model_name": TARGET,
                           "tensorrt_llm_draft_model_name": DRAFT, "multimodal_encoders_name": ""})
    return model


def _step(model_name: str, inputs: dict[str, str], outputs: dict[str, str]) -> mc.ModelEnsembling.Step:
    step = mc.ModelEnsembling.Step(model_name=model_name, model_version=-1)
    step.input_map.update(inputs)
    step.output_map.update(outputs)
    return step


def ensemble_config(config: PipelineConfig) -> mc.ModelConfig:
    model = mc.ModelConfig(name=ENSEMBLE, platform="ensemble", max_batch_size=config.build.max_batch_size)
    extra = [(n, "BOOL", [1], "o") for n in ("return_log_probs", "return_context_logits",
                                             "return_generation_logits", "return_perf_metrics")]
    _add(T.TEXT_REQUEST_INPUTS + extra + [("num_return_sequences", "INT32", [1], "o")], model)
    _add(T.TEXT_OUTPUTS, model, outputs=True)
    pre = _step(PREPROCESSING, {
        "QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "BAD_WORDS_DICT": "bad_words",
        "STOP_WORDS_DICT": "stop_words", "EMBEDDING_BIAS_WORDS": "embedding_bias_words",
        "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights", "END_ID": "end_id", "PAD_ID": "pad_id",
    }, {
        "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN", "INPUT_ID": "_INPUT_ID",
        "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN", "STOP_WORDS_IDS": "_STOP_WORDS_IDS",
        "BAD_WORDS_IDS": "_BAD_WORDS_IDS", "EMBEDDING_BIAS": "_EMBEDDING_BIAS",
        "OUT_END_ID": "_PREPROCESSOR_END_ID", "OUT_PAD_ID": "_PREPROCESSOR_PAD_ID",
    })
    passthrough = ["temperature", "repetition_penalty", "min_tokens", "presence_penalty", "frequency_penalty",
                   "seed", "beam_width", "exclude_input_in_output", "return_log_probs", "return_context_logits",
                   "return_generation_logits", "return_perf_metrics", "num_return_sequences"]
    llm_inputs = {
        "input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN", "request_output_len": "_REQUEST_OUTPUT_LEN",
        "end_id": "_PREPROCESSOR_END_ID", "pad_id": "_PREPROCESSOR_PAD_ID", "embedding_bias": "_EMBEDDING_BIAS",
        "stop_words_list": "_STOP_WORDS_IDS", "bad_words_list": "_BAD_WORDS_IDS", "runtime_top_k": "top_k",
        "runtime_top_p": "top_p", "len_penalty": "length_penalty", "streaming": "stream",
        **{name: name for name in passthrough},
    }
    llm_outputs = {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH",
                   **{row[0]: row[0] for row in T.LOGPROB_OUTPUTS + T.STATS_OUTPUTS}}
    llm = _step(TARGET, llm_inputs, llm_outputs)
    post = _step(POSTPROCESSING, {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
                 {"OUTPUT": "text_output"})
    model.ensemble_scheduling.step.extend([pre, llm, post])
    return model


def repository_configs(config: PipelineConfig, paths: TrtllmPaths) -> list[mc.ModelConfig]:
    ranks = RankPlan.for_config(config)
    return [
        preprocessing_config(config, paths),
        postprocessing_config(config, paths),
        tensorrt_llm_config(config, TARGET, paths.target_engine, config.runtime.target_device_ids,
                            ranks.target_ranks),
        tensorrt_llm_config(config, DRAFT, paths.draft_engine, config.runtime.draft_device_ids, ranks.draft_ranks),
        bls_config(config),
        ensemble_config(config),
    ]


def launch_argv(config: PipelineConfig, repo: Path | str, launcher: str = "${LAUNCHER}") -> list[str]:
    """The container's launcher: one MPI rank per GPU process plus the orchestrator (see RankPlan)."""
    serve = config.serve
    return ["python3", launcher, "--world_size", str(RankPlan.for_config(config).world_size),
            "--model_repo", str(repo), "--tensorrt_llm_model_name", f"{TARGET},{DRAFT}", "--multi-model",
            "--disable-spawn-processes", "--http_port", str(serve.http_port), "--grpc_port", str(serve.grpc_port),
            "--metrics_port", str(serve.metrics_port)]


def launch_command(config: PipelineConfig, repo: Path | str, launcher: str = "${LAUNCHER}") -> str:
    # Shell variables ("${LAUNCHER}", "\"$HERE\"") stay unquoted so the shell expands them.
    return " ".join(a if a.startswith(("${", '"$')) else shlex.quote(a) for a in launch_argv(config, repo, launcher))


def _launch_script(config: PipelineConfig) -> str:
    copies = "\n".join(f'cp -r "$UPSTREAM/{m}/1/." "$HERE/{m}/1/"' for m in UPSTREAM_PYTHON_MODELS)
    command = launch_command(config, '"$HERE"')
    return f"""#!/usr/bin/env bash
# Generated by `python -m pipeline deploy` for config {config.name!r}. Run inside {CONTAINER}
# (TensorRT-LLM {TRTLLM_RELEASE}) with the engines at the paths named in */config.pbtxt.
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
# The Python models (preprocessing, postprocessing, tensorrt_llm_bls) are upstream's model.py files of the same
# release: point UPSTREAM at triton_backend/all_models/inflight_batcher_llm of a TensorRT-LLM {TRTLLM_RELEASE} checkout.
UPSTREAM="${{TRTLLM_TRITON_MODELS:?set TRTLLM_TRITON_MODELS to <TensorRT-LLM {TRTLLM_RELEASE}>/triton_backend/all_models/inflight_batcher_llm}}"
LAUNCHER="${{TRTLLM_TRITON_LAUNCHER:-$UPSTREAM/../../scripts/launch_triton_server.py}}"
{copies}
exec {command} "$@"
"""


def _readme(config: PipelineConfig, repo: Path, paths: TrtllmPaths) -> str:
    ranks = RankPlan.for_config(config)
    p = config.build.parallel
    return f"""# Triton repository for {config.name} (TensorRT-LLM backend)

Generated by `python -m pipeline deploy`; every config.pbtxt is written whole from the pipeline config.

| model | backend | engine / role |
|---|---|---|
| {TARGET} | tensorrtllm | target engine `{paths.target_engine}` (tp={p.tp}, pp={p.pp}, GPUs {config.runtime.target_device_ids}, MPI ranks {ranks.target_ranks}) |
| {DRAFT} | tensorrtllm | draft engine `{paths.draft_engine}` (GPUs {config.runtime.draft_device_ids}, MPI rank {ranks.draft_ranks}) |
| {BLS} | python (upstream model.py) | draft K tokens, verify on the target; request input `num_draft_tokens` (K <= {config.speculative.max_draft_len}), `use_draft_logits` |
| {PREPROCESSING} / {POSTPROCESSING} | python (upstream model.py) | tokenizer `{paths.tokenizer_dir}` |
| {ENSEMBLE} | ensemble | target only (no draft) |

The model.py files of the three Python models are NOT generated: `launch.sh` copies them from a TensorRT-LLM
{TRTLLM_RELEASE} checkout (`$TRTLLM_TRITON_MODELS`) before starting. Launch in `{CONTAINER}`:

```bash
TRTLLM_TRITON_MODELS=/path/to/TensorRT-LLM/triton_backend/all_models/inflight_batcher_llm ./launch.sh
# which runs (world size = 1 orchestrator + {len(ranks.target_ranks)} target + {len(ranks.draft_ranks)} draft ranks):
# (from the triton_backend folder of that checkout)
{launch_command(config, repo, DISPLAY_LAUNCHER)}
```

Request with speculative decoding (K={config.speculative.max_draft_len}):

```bash
curl -s localhost:{config.serve.http_port}/v2/models/{BLS}/generate \\
  -d '{{"text_input": "def fibonacci(n):", "max_tokens": 64, "num_draft_tokens": {config.speculative.max_draft_len}, "use_draft_logits": {str(config.speculative.acceptance == "rejection").lower()}, "return_perf_metrics": true}}'
```
"""


def write_trtllm_repository(repo: Path, config: PipelineConfig, paths: TrtllmPaths, final_repo: Path) -> list[Path]:
    """Write into ``repo`` (a temp folder); texts name ``final_repo``, where it is renamed to on success."""
    folders = [write_model(repo, model) for model in repository_configs(config, paths)]
    script = repo / "launch.sh"
    script.write_text(_launch_script(config))
    script.chmod(0o755)
    (repo / "README.md").write_text(_readme(config, final_repo, paths))
    return folders
