"""The tensorrtllm_backend model repository for TensorRT-LLM engines (the production GPU path).

Six models for a draft engine, each config.pbtxt written whole from the pipeline config:

- ``tensorrt_llm``        C++ ``tensorrtllm`` backend on the TARGET engine (verifies draft tokens in-engine)
- ``tensorrt_llm_draft``  the same backend on the DRAFT engine
- ``tensorrt_llm_bls``    Python BLS model: preprocess, draft K tokens, verify on the target, postprocess
- ``preprocessing`` / ``postprocessing``  tokenizer in / out (Python)
- ``ensemble``            preprocessing -> tensorrt_llm -> postprocessing (target only, no drafting)

For speculative.method medusa there is no draft engine and no BLS: the ``tensorrt_llm`` model's engine drafts with
its heads and verifies the tree itself (decoding_mode medusa, medusa_choices from the config), and requests go
through the ``ensemble``; four models.

The Python models run the upstream ``model.py`` files of the pinned TensorRT-LLM release (they are not
copied into this project); ``launch.sh`` copies them from the serving container (or a checkout of that release)
into the version folders before starting the server. Every config.pbtxt declares each tensor and parameter of the
release's template (tests/data/trtllm_1.1.0_triton, checked by tests/test_trtllm_templates.py); the parameters
left out are listed with the reason in ``TENSORRT_LLM_UNSET`` and ``PREPROCESSING_UNSET``.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from ..backends.trtllm_api import (CONTAINER_TRITON_LAUNCHER, CONTAINER_TRITON_MODELS, PINNED_VERSION,
                                   TOKENIZER_DIR, TRITON_CONTAINER, is_medusa, kv_cache_fractions, medusa_choices)
from ..backends.trtllm_preflight import read_engine_config
from ..config import PipelineConfig
from . import trtllm_tensors as T
from .pbtxt import cpu_instances, set_parameters, tensor_in, tensor_out, write_model

TARGET, DRAFT, BLS, ENSEMBLE = "tensorrt_llm", "tensorrt_llm_draft", "tensorrt_llm_bls", "ensemble"
PREPROCESSING, POSTPROCESSING = "preprocessing", "postprocessing"
UPSTREAM_PYTHON_MODELS = (PREPROCESSING, POSTPROCESSING, BLS)
TRTLLM_RELEASE = PINNED_VERSION
CONTAINER = TRITON_CONTAINER
DISPLAY_LAUNCHER = "scripts/launch_triton_server.py"  # relative to TensorRT-LLM's triton_backend/ folder
USE_DRAFT_LOGITS = "use_draft_logits"  # the BLS request input that forwards draft logits to the target

# Template parameters of tensorrt_llm/config.pbtxt that we leave out. model_instance_state.cc reads each inside a
# try/catch and falls back to its default when the key is missing (only tokenizer_dir, xgrammar_tokenizer_info_path
# and guided_decoding_backend are read without one, and those we always write).
TENSORRT_LLM_UNSET: dict[str, str] = {
    "encoder_model_path": "decoder-only engines; an empty path fails its existence check, so leave it out",
    "max_tokens_in_paged_kv_cache": "the KV cache is sized by kv_cache_free_gpu_mem_fraction instead",
    "max_attention_window_size": "no sliding-window attention: the window is the engine's max_seq_len",
    "sink_token_length": "no attention sinks",
    "cross_kv_cache_fraction": "encoder-decoder models only (the runtime rejects it for decoder-only engines)",
    "iter_stats_max_iterations": "executor default",
    "request_stats_max_iterations": "executor default",
    "lora_cache_optimal_adapter_size": "no LoRA adapters",
    "lora_cache_max_adapter_size": "no LoRA adapters",
    "lora_cache_gpu_memory_fraction": "no LoRA adapters",
    "lora_cache_host_memory_bytes": "no LoRA adapters",
    "lora_prefetch_dir": "no LoRA adapters",
    "lookahead_window_size": "read only when decoding_mode is lookahead",
    "lookahead_ngram_size": "read only when decoding_mode is lookahead",
    "lookahead_verification_set_size": "read only when decoding_mode is lookahead",
    "medusa_choices": "no Medusa heads (draft_tokens_external); written for speculative.method medusa",
    "eagle_choices": "no EAGLE heads (draft_tokens_external)",
}

# preprocessing/1/model.py reads max_num_images with .get() and uses None when it is missing (multimodal only).
PREPROCESSING_UNSET: dict[str, str] = {"max_num_images": "text-only models; model.py uses None when missing"}


def tensorrt_llm_unset(config: PipelineConfig) -> dict[str, str]:
    """TENSORRT_LLM_UNSET for this config: a Medusa target's model writes medusa_choices."""
    if not is_medusa(config):
        return TENSORRT_LLM_UNSET
    return {key: reason for key, reason in TENSORRT_LLM_UNSET.items() if key != "medusa_choices"}


def medusa_choices_text(paths: list[list[int]]) -> str:
    """medusa_choices as the tensorrt_llm model's parameter: "{0}, {0, 0}, {1}" (tensorrt_llm/1/model.py turns the
    braces into brackets and reads it as JSON); every node of the tree once, parents first."""
    return ", ".join("{" + ", ".join(str(rank) for rank in path) + "}" for path in medusa_choices(paths))


@dataclass(frozen=True)
class TrtllmPaths:
    """Absolute paths the generated configs point at (inside the serving container they must exist as-is)."""

    target_engine: Path  # <engines>/<name>/target/build
    draft_engine: Path  # <engines>/<name>/draft/build
    tokenizer_dir: str  # local folder, or a hub id that AutoTokenizer can resolve

    @classmethod
    def for_engines(cls, target_engine: Path, draft_engine: Path, tokenizer_dir: str | None = None) -> TrtllmPaths:
        """The tokenizer defaults to the copy `build` puts in the target engine folder: no hub, no token."""
        return cls(Path(target_engine), Path(draft_engine), tokenizer_dir or str(Path(target_engine) / TOKENIZER_DIR))


@dataclass(frozen=True)
class EngineVocab:
    """Embedding rows of the built engines (their config.json), or None while an engine is not built yet."""

    target: int | None
    draft: int | None

    @classmethod
    def read(cls, paths: TrtllmPaths) -> EngineVocab:
        def rows(folder: Path) -> int | None:
            return read_engine_config(folder).vocab_size if (folder / "config.json").is_file() else None

        return cls(rows(paths.target_engine), rows(paths.draft_engine))

    @property
    def differ(self) -> bool:
        return None not in (self.target, self.draft) and self.target != self.draft


def forwards_draft_logits(config: PipelineConfig, vocab: EngineVocab) -> bool:
    """Whether the BLS may hand draft logits to the target (rejection sampling inside the engine).

    Upstream's tensorrt_llm_bls passes the draft's generation logits on at the draft's width; the target needs its
    own width (Qwen2.5 7B 152064 rows, 0.5B 151936), and unlike our executor the BLS does not pad them. For such a
    pair the repository leaves `use_draft_logits` out (requests use token matching, still lossless); while the
    engines are not built, launch.sh checks the widths before starting.
    """
    return config.speculative.acceptance == "rejection" and not vocab.differ and not is_medusa(config)


def stage_inputs(paths: TrtllmPaths, vocab: EngineVocab) -> dict:
    """What the repository depends on besides the config (deploy reruns when an engine appears or changes)."""
    return {"target_engine": str(paths.target_engine), "draft_engine": str(paths.draft_engine),
            "tokenizer_dir": paths.tokenizer_dir, "release": TRTLLM_RELEASE,
            "vocab": {"target": vocab.target, "draft": vocab.draft}}


@dataclass(frozen=True)
class RankPlan:
    """MPI layout for the TensorRT-LLM models in one server (orchestrator mode, processes not spawned).

    Rank 0 is the Triton orchestrator; the target takes ranks 1..tp*pp and the draft (TP=1), if any, the next rank.
    """

    target_ranks: list[int]
    draft_ranks: list[int]  # empty without a draft engine (medusa)

    @classmethod
    def for_config(cls, config: PipelineConfig) -> RankPlan:
        n = config.build.parallel.world_size
        return cls(list(range(1, n + 1)), [n + 1] if "draft" in config.roles else [])

    @property
    def world_size(self) -> int:
        return 1 + len(self.target_ranks) + len(self.draft_ranks)


def _add(rows: list[T.Row], config: mc.ModelConfig, outputs: bool = False, skip: tuple[str, ...] = ()) -> None:
    seen = set(skip)
    for name, dtype, dims, flags in rows:
        if name in seen:  # upstream's ensemble lists kv_cache_alloc_total_blocks twice; declare it once
            continue
        seen.add(name)
        if outputs:
            config.output.append(tensor_out(name, dtype, dims))
        else:
            config.input.append(tensor_in(name, dtype, dims, optional="o" in flags, ragged="r" in flags,
                                          reshape=[] if "s" in flags else None))


def _ids(values: list[int]) -> str:
    return ",".join(str(v) for v in values)


def tensorrt_llm_config(config: PipelineConfig, name: str, engine_dir: Path, device_ids: list[int],
                        participant_ids: list[int], kv_fraction: float, fast_logits: bool,
                        medusa: list[list[int]] | None = None) -> mc.ModelConfig:
    """One tensorrtllm-backend model; ``medusa``: the tree of a Medusa engine (its rank paths), else None."""
    kv = config.build.kv_cache
    model = mc.ModelConfig(name=name, backend="tensorrtllm", max_batch_size=config.build.max_batch_size)
    # Speculative decoding through the BLS is request/response only (upstream: no streaming with a draft model);
    # a Medusa model keeps the same setting.
    model.model_transaction_policy.decoupled = False
    model.dynamic_batching.preferred_batch_size.append(config.build.max_batch_size)
    model.dynamic_batching.max_queue_delay_microseconds = config.serve.max_queue_delay_us
    _add(T.TENSORRT_LLM_INPUTS, model)
    _add(T.TENSORRT_LLM_OUTPUTS, model, outputs=True)
    model.instance_group.append(cpu_instances(1))  # the C++ backend owns its GPUs via gpu_device_ids
    set_parameters(model, {
        "max_beam_width": 1,  # draft_tokens_external supports beam width 1 only
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": engine_dir,
        "batch_scheduler_policy": "guaranteed_no_evict",
        # Split with the other model when they share a GPU (kv_cache_fractions), as the Python executor does.
        "kv_cache_free_gpu_mem_fraction": kv_fraction,
        "kv_cache_host_memory_bytes": 0,  # no offload of KV blocks to host memory
        "kv_cache_onboard_blocks": True,
        "exclude_input_in_output": False,
        "cancellation_check_period_ms": 100,
        "stats_check_period_ms": 100,
        "enable_kv_cache_reuse": kv.enable_block_reuse,
        "normalize_log_probs": True,
        "enable_chunked_context": False,
        "gpu_device_ids": _ids(device_ids),
        "participant_ids": _ids(participant_ids),
        "num_nodes": 1,  # launch.sh starts every rank on this machine
        # Sampling decoder; the external-draft-tokens path is switched on per request by draft_input_ids. A Medusa
        # engine decodes with its heads (tensorrt_llm/1/model.py maps "medusa" to DecodingMode.Medusa()).
        "decoding_mode": "top_k_top_p" if medusa is None else "medusa",
        "executor_worker_path": "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker",
        "gpu_weights_percent": 1.0,  # every weight stays on the GPU
        "enable_context_fmha_fp32_acc": False,
        "multi_block_mode": True,
        "cuda_graph_mode": False,
        "cuda_graph_cache_size": 0,
        # Draft logits go GPU to GPU between the two executors; needs the orchestrator rank layout above.
        "speculative_decoding_fast_logits": fast_logits,
        # Read without a default by model_instance_state.cc (a missing key stops the model from loading). The
        # C++ guided decoder does not use tokenizer_dir; it names the tokenizer copy of this engine all the same.
        "tokenizer_dir": engine_dir / TOKENIZER_DIR,
        "guided_decoding_backend": "",  # empty: no guided decoding
        "xgrammar_tokenizer_info_path": "",
    })
    if medusa is not None:
        # The tree the engine verifies; left out, the backend would use its default mc_sim_7b_63 whatever tree the
        # config names.
        set_parameters(model, {"medusa_choices": medusa_choices_text(medusa)})
    return model


def preprocessing_config(config: PipelineConfig, paths: TrtllmPaths) -> mc.ModelConfig:
    model = mc.ModelConfig(name=PREPROCESSING, backend="python", max_batch_size=config.build.max_batch_size)
    model.dynamic_batching.preferred_batch_size.append(config.build.max_batch_size)
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


def bls_config(config: PipelineConfig, draft_logits: bool) -> mc.ModelConfig:
    model = mc.ModelConfig(name=BLS, backend="python", max_batch_size=config.build.max_batch_size)
    model.model_transaction_policy.decoupled = False
    # Without use_draft_logits Triton refuses a request that sets it, and the BLS verifies by token matching.
    _add(T.BLS_INPUTS, model, skip=() if draft_logits else (USE_DRAFT_LOGITS,))
    _add(T.BLS_OUTPUTS, model, outputs=True)
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


# The ensemble's wiring, step by step: {step input: ensemble tensor}, {step output: ensemble tensor}.
_PRE_IN = {"QUERY": "text_input", "DECODER_QUERY": "decoder_text_input", "REQUEST_OUTPUT_LEN": "max_tokens",
           "BAD_WORDS_DICT": "bad_words", "STOP_WORDS_DICT": "stop_words",
           "EMBEDDING_BIAS_WORDS": "embedding_bias_words", "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights",
           "END_ID": "end_id", "PAD_ID": "pad_id", "PROMPT_TABLE_EXTRA_ID": "prompt_table_extra_id"}
_PRE_OUT = {name: f"_{name}" for name in ("REQUEST_INPUT_LEN", "INPUT_ID", "REQUEST_DECODER_INPUT_LEN",
                                          "DECODER_INPUT_ID", "REQUEST_OUTPUT_LEN", "STOP_WORDS_IDS",
                                          "BAD_WORDS_IDS", "EMBEDDING_BIAS", "OUT_PROMPT_TABLE_EXTRA_IDS")}
_PRE_OUT.update({"OUT_END_ID": "_PREPROCESSOR_END_ID", "OUT_PAD_ID": "_PREPROCESSOR_PAD_ID"})
_LLM_SAME = ("exclude_input_in_output", "temperature", "repetition_penalty", "min_tokens", "presence_penalty",
             "frequency_penalty", "seed", "return_log_probs", "return_context_logits", "return_generation_logits",
             "return_perf_metrics", "return_num_input_tokens", "return_num_output_tokens", "num_return_sequences",
             "beam_width", "prompt_embedding_table", "prompt_vocab_size", "lora_task_id", "lora_weights",
             "lora_config", "guided_decoding_guide_type", "guided_decoding_guide")
_LLM_IN = {"input_ids": "_INPUT_ID", "decoder_input_ids": "_DECODER_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN",
           "decoder_input_lengths": "_REQUEST_DECODER_INPUT_LEN", "request_output_len": "_REQUEST_OUTPUT_LEN",
           "end_id": "_PREPROCESSOR_END_ID", "pad_id": "_PREPROCESSOR_PAD_ID", "embedding_bias": "_EMBEDDING_BIAS",
           "runtime_top_k": "top_k", "runtime_top_p": "top_p", "len_penalty": "length_penalty",
           "streaming": "stream", "stop_words_list": "_STOP_WORDS_IDS", "bad_words_list": "_BAD_WORDS_IDS",
           "prompt_table_extra_ids": "_OUT_PROMPT_TABLE_EXTRA_IDS", **{name: name for name in _LLM_SAME}}


def ensemble_config(config: PipelineConfig) -> mc.ModelConfig:
    model = mc.ModelConfig(name=ENSEMBLE, platform="ensemble", max_batch_size=config.build.max_batch_size)
    _add(T.ENSEMBLE_INPUTS, model)
    _add(T.ENSEMBLE_OUTPUTS, model, outputs=True)
    llm_out = {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH",
               **{row[0]: row[0] for row in T.ENSEMBLE_OUTPUTS if row[0] != "text_output"}}
    model.ensemble_scheduling.step.extend([
        _step(PREPROCESSING, _PRE_IN, _PRE_OUT),
        _step(TARGET, _LLM_IN, llm_out),
        _step(POSTPROCESSING, {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
              {"OUTPUT": "text_output"}),
    ])
    return model


def repository_kv_fractions(config: PipelineConfig) -> tuple[float, float]:
    """(target, draft) KV-cache fractions; without a draft engine the target takes the configured one."""
    fraction = config.build.kv_cache.free_gpu_mem_fraction
    if "draft" not in config.roles:
        return fraction, 0.0
    return kv_cache_fractions(fraction, config.runtime.target_device_ids, config.runtime.draft_device_ids)


def python_models(config: PipelineConfig) -> tuple[str, ...]:
    """The upstream Python models this repository runs (the BLS only for a draft engine)."""
    return UPSTREAM_PYTHON_MODELS if "draft" in config.roles else (PREPROCESSING, POSTPROCESSING)


def repository_configs(config: PipelineConfig, paths: TrtllmPaths,
                       vocab: EngineVocab | None = None) -> list[mc.ModelConfig]:
    ranks = RankPlan.for_config(config)
    runtime = config.runtime
    target_kv, draft_kv = repository_kv_fractions(config)
    if is_medusa(config):  # no draft engine, no BLS: the ensemble feeds the Medusa engine directly
        return [preprocessing_config(config, paths), postprocessing_config(config, paths),
                tensorrt_llm_config(config, TARGET, paths.target_engine, runtime.target_device_ids,
                                    ranks.target_ranks, target_kv, False, config.speculative.medusa.paths()),
                ensemble_config(config)]
    draft_logits = forwards_draft_logits(config, vocab or EngineVocab(None, None))
    return [
        preprocessing_config(config, paths),
        postprocessing_config(config, paths),
        tensorrt_llm_config(config, TARGET, paths.target_engine, runtime.target_device_ids, ranks.target_ranks,
                            target_kv, draft_logits),
        tensorrt_llm_config(config, DRAFT, paths.draft_engine, runtime.draft_device_ids, ranks.draft_ranks,
                            draft_kv, draft_logits),
        bls_config(config, draft_logits),
        ensemble_config(config),
    ]


def launch_argv(config: PipelineConfig, repo: Path | str, launcher: str = "${LAUNCHER}") -> list[str]:
    """The container's launcher: one MPI rank per GPU process plus the orchestrator (see RankPlan)."""
    serve = config.serve
    models = f"{TARGET},{DRAFT}" if "draft" in config.roles else TARGET
    return ["python3", launcher, "--world_size", str(RankPlan.for_config(config).world_size),
            "--model_repo", str(repo), "--tensorrt_llm_model_name", models, "--multi-model",
            "--disable-spawn-processes", "--http_port", str(serve.http_port), "--grpc_port", str(serve.grpc_port),
            "--metrics_port", str(serve.metrics_port)]


def launch_command(config: PipelineConfig, repo: Path | str, launcher: str = "${LAUNCHER}") -> str:
    # Shell variables ("${LAUNCHER}", "\"$HERE\"") are double-quoted, not single-quoted, so the shell expands them.
    return " ".join(a if a.startswith('"$') else f'"{a}"' if a.startswith("${") else shlex.quote(a)
                    for a in launch_argv(config, repo, launcher))


def _vocab_check(paths: TrtllmPaths) -> str:
    """Shell lines refusing to start when the engines' widths differ but the BLS would forward draft logits."""
    files = " ".join(shlex.quote(str(p / "config.json")) for p in (paths.target_engine, paths.draft_engine))
    return f"""# Draft logits reach the target unpadded (upstream tensorrt_llm_bls): refuse engines of different widths.
python3 - {files} <<'PY'
import json, pathlib, sys
rows = []
for path in sys.argv[1:]:
    if not pathlib.Path(path).is_file():
        sys.exit(f"error: {{path}}: missing; build the engines first (python -m pipeline build CONFIG)")
    rows.append(json.loads(pathlib.Path(path).read_text())["pretrained_config"]["vocab_size"])
if rows[0] != rows[1]:
    sys.exit(f"error: {{sys.argv[2]}}: pretrained_config.vocab_size is {{rows[1]}} but the target's is {{rows[0]}}, "
             f"and this repository lets requests set {USE_DRAFT_LOGITS}, which forwards draft logits unpadded; "
             f"rerun `python -m pipeline deploy CONFIG --force` now that the engines are built (it then leaves "
             f"{USE_DRAFT_LOGITS} out), or set speculative.acceptance: greedy")
PY
"""


def _launch_script(config: PipelineConfig, paths: TrtllmPaths, draft_logits: bool) -> str:
    models = python_models(config)
    copies = "\n".join(f'cp -r "$UPSTREAM/{m}/1/." "$HERE/{m}/1/"' for m in models)
    command = launch_command(config, '"$HERE"')
    check = _vocab_check(paths) if draft_logits else ""
    what = (f"the Medusa target (speculative_decoding_mode medusa, greedy requests only)" if is_medusa(config)
            else "the target and draft engines")
    return f"""#!/usr/bin/env bash
# Generated by `python -m pipeline deploy` for config {config.name!r}: Triton on {what}. Run inside {CONTAINER}
# (TensorRT-LLM {TRTLLM_RELEASE}) with the engines at the paths named in */config.pbtxt.
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
# The Python models ({', '.join(models)}) are upstream's model.py files of the same
# release: the container keeps them in {CONTAINER_TRITON_MODELS}; elsewhere point TRTLLM_TRITON_MODELS at
# triton_backend/all_models/inflight_batcher_llm of a TensorRT-LLM {TRTLLM_RELEASE} checkout.
UPSTREAM="${{TRTLLM_TRITON_MODELS:-{CONTAINER_TRITON_MODELS}}}"
LAUNCHER="${{TRTLLM_TRITON_LAUNCHER:-{CONTAINER_TRITON_LAUNCHER}}}"
if [ ! -d "$UPSTREAM/{models[-1]}/1" ]; then
  echo "error: TRTLLM_TRITON_MODELS: $UPSTREAM has no {models[-1]}/1; point it at triton_backend/all_models/inflight_batcher_llm of TensorRT-LLM {TRTLLM_RELEASE}" >&2
  exit 1
fi
{check}{copies}
exec {command} "$@"
"""


def _readme(config: PipelineConfig, repo: Path, paths: TrtllmPaths, draft_logits: bool, vocab: EngineVocab,
            kv: tuple[float, float]) -> str:
    ranks = RankPlan.for_config(config)
    p = config.build.parallel
    if draft_logits:
        logits = ("requests may set `use_draft_logits` (rejection sampling inside the target engine, draft logits "
                  "sent GPU to GPU); launch.sh first checks that both engines have the same vocabulary width")
    elif vocab.differ:
        logits = (f"`use_draft_logits` is left out: the engines' vocabularies differ ({vocab.target} target rows, "
                  f"{vocab.draft} draft rows) and upstream's BLS forwards draft logits unpadded, so the target "
                  f"verifies by token matching (lossless; fewer tokens accepted under sampling)")
    else:
        logits = "speculative.acceptance is greedy: the target verifies by token matching"
    return f"""# Triton repository for {config.name} (TensorRT-LLM backend)

Generated by `python -m pipeline deploy`; every config.pbtxt is written whole from the pipeline config and
declares every tensor and parameter of the TensorRT-LLM {TRTLLM_RELEASE} templates, except parameters of features
this pipeline does not use (LoRA, Medusa, lookahead, ...), left out so the backend takes its defaults; the list and
reasons are `TENSORRT_LLM_UNSET` in pipeline/triton/trtllm_repo.py.

| model | backend | engine / role |
|---|---|---|
| {TARGET} | tensorrtllm | target engine `{paths.target_engine}` (tp={p.tp}, pp={p.pp}, GPUs {config.runtime.target_device_ids}, MPI ranks {ranks.target_ranks}, kv_cache_free_gpu_mem_fraction {kv[0]}) |
| {DRAFT} | tensorrtllm | draft engine `{paths.draft_engine}` (GPUs {config.runtime.draft_device_ids}, MPI rank {ranks.draft_ranks}, kv_cache_free_gpu_mem_fraction {kv[1]}) |
| {BLS} | python (upstream model.py) | draft K tokens, verify on the target; request input `num_draft_tokens` (K <= {config.speculative.max_draft_len}) |
| {PREPROCESSING} / {POSTPROCESSING} | python (upstream model.py) | tokenizer `{paths.tokenizer_dir}` |
| {ENSEMBLE} | ensemble | target only (no draft) |

Draft logits: {logits}.

The model.py files of the three Python models are NOT generated: `launch.sh` copies them from
`{CONTAINER_TRITON_MODELS}` (or `$TRTLLM_TRITON_MODELS`) before starting. Launch in `{CONTAINER}`:

```bash
./launch.sh
# which runs (world size = 1 orchestrator + {len(ranks.target_ranks)} target + {len(ranks.draft_ranks)} draft ranks):
# (from the triton_backend folder of that release)
{launch_command(config, repo, DISPLAY_LAUNCHER)}
```

Request with speculative decoding (K={config.speculative.max_draft_len}):

```bash
curl -s localhost:{config.serve.http_port}/v2/models/{BLS}/generate \\
  -d '{{"text_input": "def fibonacci(n):", "max_tokens": 64, "num_draft_tokens": {config.speculative.max_draft_len}{', "use_draft_logits": true' if draft_logits else ''}, "return_perf_metrics": true}}'
```
"""


def _medusa_readme(config: PipelineConfig, repo: Path, paths: TrtllmPaths, kv: float) -> str:
    ranks = RankPlan.for_config(config)
    p = config.build.parallel
    medusa = config.speculative.medusa
    tree = medusa.tree()
    name = medusa.choices if isinstance(medusa.choices, str) else "from the config"
    return f"""# Triton repository for {config.name} (TensorRT-LLM backend, Medusa)

Generated by `python -m pipeline deploy`; every config.pbtxt is written whole from the pipeline config and
declares every tensor and parameter of the TensorRT-LLM {TRTLLM_RELEASE} templates, except parameters of features
this pipeline does not use (LoRA, lookahead, EAGLE, ...), left out so the backend takes its defaults; the list and
reasons are `tensorrt_llm_unset()` in pipeline/triton/trtllm_repo.py.

Speculative decoding with Medusa heads: the target engine drafts with its {medusa.heads} heads and verifies the
candidate tree (`decoding_mode` medusa, `medusa_choices`: tree {name}, {tree.size - 1} nodes, depth
{tree.max_depth}) inside, every step. No draft engine, no BLS model.

| model | backend | engine / role |
|---|---|---|
| {TARGET} | tensorrtllm | Medusa target engine `{paths.target_engine}` (tp={p.tp}, pp={p.pp}, GPUs {config.runtime.target_device_ids}, MPI ranks {ranks.target_ranks}, kv_cache_free_gpu_mem_fraction {kv}) |
| {PREPROCESSING} / {POSTPROCESSING} | python (upstream model.py) | tokenizer `{paths.tokenizer_dir}` |
| {ENSEMBLE} | ensemble | preprocessing -> {TARGET} (Medusa) -> postprocessing: the request path |

Greedy only: TensorRT-LLM {TRTLLM_RELEASE}'s Medusa keeps draft tokens equal to the target's top-1 token. The server
does not refuse sampling parameters, but with `temperature` > 0 (and `top_k` other than 1) the output does not
follow the target's distribution; leave them unset (the engine's default top-k is 1), or serve with backend: torch,
which samples losslessly over the tree.

The model.py files of the two Python models are NOT generated: `launch.sh` copies them from
`{CONTAINER_TRITON_MODELS}` (or `$TRTLLM_TRITON_MODELS`) before starting. Launch in `{CONTAINER}`:

```bash
./launch.sh
# which runs (world size = 1 orchestrator + {len(ranks.target_ranks)} target ranks):
# (from the triton_backend folder of that release)
{launch_command(config, repo, DISPLAY_LAUNCHER)}
```

Request (greedy; `return_perf_metrics` returns the engine's acceptance counts):

```bash
curl -s localhost:{config.serve.http_port}/v2/models/{ENSEMBLE}/generate \\
  -d '{{"text_input": "def fibonacci(n):", "max_tokens": 64, "return_perf_metrics": true}}'
```
"""


def write_trtllm_repository(repo: Path, config: PipelineConfig, paths: TrtllmPaths, final_repo: Path,
                            vocab: EngineVocab | None = None) -> list[Path]:
    """Write into ``repo`` (a temp folder); texts name ``final_repo``, where it is renamed to on success."""
    vocab = vocab or EngineVocab(None, None)
    draft_logits = forwards_draft_logits(config, vocab)
    if config.speculative.acceptance == "rejection" and not draft_logits and not is_medusa(config):
        print(f"note: {paths.draft_engine}: vocab_size {vocab.draft} differs from the target's {vocab.target}; "
              f"the Triton BLS forwards draft logits unpadded, so this repository leaves {USE_DRAFT_LOGITS} out "
              f"and verifies by token matching", file=sys.stderr)
    folders = [write_model(repo, model) for model in repository_configs(config, paths, vocab)]
    script = repo / "launch.sh"
    script.write_text(_launch_script(config, paths, draft_logits))
    script.chmod(0o755)
    kv = repository_kv_fractions(config)
    readme = _medusa_readme(config, final_repo, paths, kv[0]) if is_medusa(config) else \
        _readme(config, final_repo, paths, draft_logits, vocab, kv)
    (repo / "README.md").write_text(readme)
    return folders
