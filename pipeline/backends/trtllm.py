"""The TensorRT-LLM backend (pinned release 1.1.0, what tritonserver:25.12-trtllm-python-py3 ships): converter
API -> checkpoint (for a Medusa target, the release's examples/medusa/convert_checkpoint.py, which adds the heads),
`trtllm-build` -> engine.

tensorrt_llm is imported lazily: planning (`build --dry-run`) works anywhere, and every step that needs
TensorRT-LLM or a GPU raises BackendUnavailable with one line saying what is missing and how to get it.
Helpers live in trtllm_api (pinned facts, argv), trtllm_preflight (engine checks), trtllm_runner (the engine
runner over ModelRunnerCpp) and trtllm_loading (opening built engines); the draft-target loop is
pipeline.executor.trtllm_executor, shared contract and all.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from ..config import PipelineConfig
from ..errors import BackendUnavailable, CompatibilityError, EngineError
from ..gguf import dequantized_folder_label
from ..models import ResolvedModel, load_tokenizer, read_hf_config
from .trtllm_api import (CONTAINER_TRTLLM_EXAMPLES, EXAMPLES_ENV, MEDUSA_CONVERTER, PINNED_VERSION, TOKENIZER_DIR,
                         build_argv, check_medusa_model_type, convert_calls, format_argv, import_tensorrt_llm,
                         is_medusa, medusa_convert_argv, medusa_converter_script, medusa_nodes,
                         needs_generation_logits, require_cuda_gpu, require_trtllm_build, role_parallel)
from ..engine_info import ENGINE_FILE, engine_fields, write_engine_info
from .trtllm_preflight import (check_context_logits, check_medusa_mode, check_target_spec_mode, raise_if_problems,
                               read_engine_config)

__all__ = ["convert_plan", "convert", "build_plan", "build", "engine_info", "PINNED_VERSION"]

BUILD_LOG = "trtllm-build.log"
CONVERT_LOG = "convert_checkpoint.log"


# ---- convert ---------------------------------------------------------------------------------------------------------

def _converter_label(config: PipelineConfig, role: str) -> str:
    # The class comes from the checkpoint's config.json at convert time; the plan never touches the hub.
    return f"tensorrt_llm.models.MODEL_MAP[<architectures[0] of {getattr(config, role).model}>]"


def convert_plan(config: PipelineConfig, role: str, out_dir: Path) -> list[str]:
    """The converter calls `convert` will make, one line each (Python, not shell: there is no converter CLI), or
    for a Medusa target the converter script's command line."""
    label = _converter_label(config, role)
    source = getattr(config, role).model
    lines = [f"# convert {role}: {source} -> {out_dir} (TensorRT-LLM {PINNED_VERSION})"]
    if source.lower().endswith(".gguf"):  # the converters read HF folders: convert hands them the dequantized one
        source = dequantized_folder_label(Path(source))
        lines.append(f"# {getattr(config, role).model} is dequantized first (transformers' GGUF loader, float32, "
                     f"once) into {source}")
    if role == "target" and is_medusa(config):
        # The plan never reads the model: model_type comes from its config.json at convert time.
        argv = medusa_convert_argv(config, source, f"<model_type in {source}/config.json>", out_dir)
        return lines + [f"# with the Medusa heads in {config.medusa_dir()}, by the release's examples/"
                        f"{MEDUSA_CONVERTER} (under ${EXAMPLES_ENV}, else {CONTAINER_TRTLLM_EXAMPLES})",
                        format_argv(argv)]
    lines += [call.describe(source, out_dir, label) for call in convert_calls(config, role)]
    return lines


def convert(config: PipelineConfig, role: str, model: ResolvedModel, out_dir: Path) -> dict:
    """HF checkpoint -> TensorRT-LLM checkpoint (config.json + rank<r>.safetensors) plus the tokenizer."""
    trtllm = import_tensorrt_llm(f"convert ({role})")
    require_cuda_gpu(f"convert ({role})")
    if role == "target" and is_medusa(config):
        return _convert_medusa(config, model, out_dir, trtllm.__version__)
    from tensorrt_llm.mapping import Mapping
    from tensorrt_llm.models import MODEL_MAP
    from tensorrt_llm.models.modeling_utils import QuantConfig
    from tensorrt_llm.quantization.mode import QuantAlgo

    arch = (read_hf_config(model).get("architectures") or ["<none>"])[0]
    if arch not in MODEL_MAP:
        raise CompatibilityError(f"{role}.model: architecture {arch} has no converter in TensorRT-LLM "
                                 f"{trtllm.__version__} (tensorrt_llm.models.MODEL_MAP); use backend: torch or a "
                                 f"supported family")
    converter = MODEL_MAP[arch]
    calls = convert_calls(config, role)
    start = time.perf_counter()
    for call in calls:
        quant = QuantConfig(quant_algo=_algo(QuantAlgo, call.quant_algo),
                            kv_cache_quant_algo=_algo(QuantAlgo, call.kv_cache_quant_algo))
        _log(call.describe(str(model.path), out_dir, converter.__name__))
        if call.method == "quantize":
            converter.quantize(str(model.path), str(out_dir), dtype=call.dtype,
                               mapping=Mapping(world_size=call.world_size, tp_size=call.tp, pp_size=call.pp),
                               quant_config=quant)
        else:
            mapping = Mapping(world_size=call.world_size, rank=call.rank, tp_size=call.tp, pp_size=call.pp)
            checkpoint = converter.from_hugging_face(str(model.path), call.dtype, mapping=mapping,
                                                     quant_config=quant)
            checkpoint.save_checkpoint(str(out_dir), save_config=call.rank == 0)
            del checkpoint  # one rank's weights at a time: a 70B model does not fit twice in host memory
    # The engine folder carries the tokenizer so the executor never goes back to the source model.
    load_tokenizer(model).save_pretrained(out_dir / TOKENIZER_DIR)
    return {"source": model.provenance(),
            "converter": {"class": converter.__name__, "architecture": arch, "calls": [c.__dict__ for c in calls],
                          "seconds": round(time.perf_counter() - start, 1)},
            "trtllm_version": trtllm.__version__}


def _convert_medusa(config: PipelineConfig, model: ResolvedModel, out_dir: Path, trtllm_version: str) -> dict:
    """Target + Medusa heads -> one MedusaForCausalLM checkpoint, by the release's converter script (the Medusa
    model has no from_hugging_face that takes a heads folder in this release's engine flow)."""
    model_type = check_medusa_model_type(read_hf_config(model).get("model_type"))
    script = medusa_converter_script()
    if not script.is_file():
        raise BackendUnavailable(f"convert (target, Medusa) needs examples/{MEDUSA_CONVERTER} of TensorRT-LLM "
                                 f"{PINNED_VERSION}, and {script} does not exist; run inside the Triton TRT-LLM "
                                 f"container (it has /app/examples) or set {EXAMPLES_ENV} to the examples folder of a "
                                 f"TensorRT-LLM {PINNED_VERSION} checkout")
    argv = medusa_convert_argv(config, str(model.path), model_type, out_dir, script)
    _log(f"[convert] target: {format_argv(argv)}")
    start = time.perf_counter()
    _run_logged(argv, out_dir / CONVERT_LOG, "the Medusa converter for the target")
    load_tokenizer(model).save_pretrained(out_dir / TOKENIZER_DIR)
    return {"source": model.provenance(),
            "converter": {"script": str(script), "argv": argv, "model_type": model_type,
                          "medusa_nodes": medusa_nodes(config), "seconds": round(time.perf_counter() - start, 1)},
            "trtllm_version": trtllm_version}


def _run_logged(argv: list[str], log_path: Path, what: str) -> None:
    """Run ``argv`` with its output in ``log_path`` (the command first); raise EngineError on a non-zero exit."""
    with open(log_path, "w") as log:
        log.write(format_argv(argv) + "\n")
        log.flush()
        code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = log_path.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise EngineError(f"{what} exited with status {code}: {tail[0][:200]}; the full output is in {log_path}, "
                          f"rerun the logged command to reproduce")


def _algo(quant_algo_enum, name: str | None):
    return getattr(quant_algo_enum, name) if name else None


# ---- build -----------------------------------------------------------------------------------------------------------

def build_plan(config: PipelineConfig, role: str, checkpoint_dir: Path, out_dir: Path) -> list[str]:
    return [format_argv(build_argv(config, role, checkpoint_dir, out_dir)),
            f"# then write {out_dir / ENGINE_FILE}: {json.dumps(engine_info(config, role, PINNED_VERSION))}"]


def engine_info(config: PipelineConfig, role: str, trtllm_version: str) -> dict:
    """engine.json: what the executor and `deploy` need to know about an engine, without TensorRT-LLM."""
    build = config.build
    par = role_parallel(config, role)
    return {
        **engine_fields(config, role, "trtllm"), "tp": par.tp, "pp": par.pp, "trtllm_version": trtllm_version,
        "gather_generation_logits": needs_generation_logits(config),
        "kv_cache_free_gpu_mem_fraction": build.kv_cache.free_gpu_mem_fraction,
        "enable_block_reuse": build.kv_cache.enable_block_reuse,
        # Build-time defaults for the executor (runtime.* does not invalidate a build; from_engines can override).
        "target_device_ids": list(config.runtime.target_device_ids),
        "draft_device_ids": list(config.runtime.draft_device_ids),
    }


def build(config: PipelineConfig, role: str, checkpoint_dir: Path, out_dir: Path) -> dict:
    """Run trtllm-build (argv logged and returned for the manifest), check the engine, write engine.json."""
    argv = build_argv(config, role, checkpoint_dir, out_dir)
    require_trtllm_build()
    require_cuda_gpu(f"build ({role})")
    if not (checkpoint_dir / "config.json").is_file():
        raise EngineError(f"{checkpoint_dir}/config.json: missing; run `python -m pipeline convert CONFIG` first")
    _log(f"[build] {role}: {format_argv(argv)}")
    start = time.perf_counter()
    _run_logged(argv, out_dir / BUILD_LOG, f"trtllm-build for the {role}")
    engine_cfg = read_engine_config(out_dir)
    if role == "target" and is_medusa(config):
        mode_problems = check_medusa_mode(engine_cfg, medusa_nodes(config))
    else:
        mode_problems = check_target_spec_mode(engine_cfg, config.speculative.max_draft_len if role == "target" else 0)
    raise_if_problems(mode_problems + check_context_logits(engine_cfg))
    info = engine_info(config, role, engine_cfg.version or PINNED_VERSION)
    info["architecture"] = engine_cfg.architecture
    info["vocab_size"] = engine_cfg.vocab_size
    tokenizer_src = checkpoint_dir / TOKENIZER_DIR
    if tokenizer_src.is_dir():
        import shutil

        shutil.copytree(tokenizer_src, out_dir / TOKENIZER_DIR)
        info["tokenizer_len"] = _tokenizer_len(out_dir / TOKENIZER_DIR)
    write_engine_info(out_dir, info)
    return {"argv": argv, "command": format_argv(argv), "engine": info,
            "build_seconds": round(time.perf_counter() - start, 1)}


def _tokenizer_len(folder: Path) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(folder))


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
