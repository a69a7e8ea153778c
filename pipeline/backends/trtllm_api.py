"""Facts about the pinned TensorRT-LLM release, and the argv/converter calls we derive from a config.

Everything here is pure (no TensorRT-LLM import), so `build --dry-run` and the contract tests run on any machine.
The option names and choices were read from NVIDIA/TensorRT-LLM (tensorrt_llm/commands/build.py,
tensorrt_llm/plugin/plugin.py, tensorrt_llm/models/__init__.py, tensorrt_llm/models/modeling_utils.py); the
contract file tests/data/trtllm_1.1.0_api.json records them with provenance (the option list extracted by
scripts/extract_trtllm_build_options.py) and the tests parse every argv we generate against it.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from ..config import PipelineConfig
from ..errors import BackendUnavailable, CompatibilityError, ConfigError
from ..speculative.tree import TokenTree

# What the Triton container ships (NVIDIA's compatibility matrix: 25.12 = TensorRT-LLM 1.1.0, TensorRT 10.13.3.9,
# CUDA 13.0.2); engines only load in the release that built them, so build and serve in this one container.
PINNED_VERSION = "1.1.0"
TRITON_CONTAINER = "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"
# Where that container keeps the Triton model templates and launcher (tensorrtllm_backend's Dockerfile copies
# TensorRT-LLM's triton_backend/all_models and scripts/ to /app).
CONTAINER_TRITON_MODELS = "/app/all_models/inflight_batcher_llm"
CONTAINER_TRITON_LAUNCHER = "/app/scripts/launch_triton_server.py"
# The same Dockerfile (tensorrtllm_backend dockerfile/Dockerfile.triton.trt_llm_backend, read at a 2025 commit, not at
# the 25.12 tag) copies the checkout's examples/ to /app/examples: the Medusa converter is a script there, not a
# module of the wheel. TRTLLM_EXAMPLES points elsewhere (the examples/ folder of a TensorRT-LLM 1.1.0 checkout), as
# TRTLLM_TRITON_MODELS does for the Triton models.
CONTAINER_TRTLLM_EXAMPLES = "/app/examples"
EXAMPLES_ENV = "TRTLLM_EXAMPLES"
MEDUSA_CONVERTER = "medusa/convert_checkpoint.py"
# examples/medusa/convert_checkpoint.py asserts --model_type is one of these before it reads the HF config.
MEDUSA_MODEL_TYPES = ("llama", "mixtral", "qwen2")
# build copies the tokenizer into every engine folder (engines/<name>/<role>/build/tokenizer), so nothing that
# runs the engines needs the source model, the hub or a token again.
TOKENIZER_DIR = "tokenizer"
INSTALL_HINT = (f"run inside the Triton TRT-LLM container {TRITON_CONTAINER}, or `pip install .[trtllm]` "
                f"(tensorrt-llm=={PINNED_VERSION}, served from NVIDIA's index https://pypi.nvidia.com)")

# SpeculativeDecodingMode is an IntFlag (NONE=1, DRAFT_TOKENS_EXTERNAL=2, ...); Engine.save writes the int into
# the engine's config.json build_config, and the C++ runtime reads it back as that integer.
SPEC_MODE_DRAFT_TOKENS_EXTERNAL = 2
SPEC_MODE_MEDUSA = 4

# QuantAlgo member names (tensorrt_llm/quantization/mode.py) for our config's modes.
WEIGHT_QUANT_ALGO = {"none": None, "fp8": "FP8", "int8_weight_only": "W8A16", "int4_awq": "W4A16_AWQ"}
KV_CACHE_QUANT_ALGO = {"none": None, "fp8": "FP8", "int8": "INT8"}
# QuantConfig._requires_calibration / _requires_modelopt_quantization: these go through
# `<Model>ForCausalLM.quantize(...)` (calibration on a GPU, writes every rank itself) instead of from_hugging_face.
CALIBRATED_WEIGHT_ALGOS = {"FP8", "W4A16_AWQ"}


@dataclass(frozen=True)
class RoleParallel:
    tp: int
    pp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp


def role_parallel(config: PipelineConfig, role: str) -> RoleParallel:
    """The target uses build.parallel; the draft always runs on one GPU (it is small and latency-bound)."""
    if role == "target":
        return RoleParallel(config.build.parallel.tp, config.build.parallel.pp)
    return RoleParallel(1, 1)


def role_quant(config: PipelineConfig, role: str) -> tuple[str | None, str | None]:
    """(weight QuantAlgo name, KV-cache QuantAlgo name); the draft stays unquantized so its logits stay exact."""
    if role != "target":
        return None, None
    quant = config.build.quantization
    return WEIGHT_QUANT_ALGO[quant.mode], KV_CACHE_QUANT_ALGO[quant.kv_cache]


def is_medusa(config: PipelineConfig) -> bool:
    return config.speculative.method.needs_medusa_heads


def needs_generation_logits(config: PipelineConfig) -> bool:
    """Draft logits reach the target only from a draft engine; Medusa heads live inside the target's engine."""
    return config.speculative.acceptance == "rejection" and not is_medusa(config)


def medusa_choices(paths: list[list[int]]) -> list[list[int]]:
    """TensorRT-LLM's medusa_choices for a tree given as rank paths: every node once, its missing prefixes added
    (only the Python runtime expands a list of leaves, tensorrt_llm/runtime/medusa_utils.py), parents before
    children (by depth, then by path)."""
    return [list(path) for path in TokenTree.from_choices(paths).paths[1:]]


def medusa_nodes(config: PipelineConfig) -> int:
    """Draft tokens a Medusa step verifies: the tree's nodes without the root (--max_medusa_token_len,
    --max_draft_len)."""
    return len(medusa_choices(config.speculative.medusa.paths()))


# Share of the KV-cache memory fraction given to the draft when it shares a GPU with the target. Both engines cache
# the same sequences, so each needs memory in proportion to its KV bytes per token (layers x KV heads x head dim):
# Llama 3.2 1B has 1/4 of Llama 3.1 8B's, Qwen2.5 0.5B about 1/4.7 of Qwen2.5 7B's, so the draft gets 1/5.
DRAFT_KV_SHARE = 0.2


def kv_cache_fractions(fraction: float, target_device_ids: list[int], draft_device_ids: list[int]
                       ) -> tuple[float, float]:
    """(target, draft) kv_cache_free_gpu_mem_fraction for the executor and for Triton alike.

    Each engine takes its fraction of the memory free when it loads. On a shared GPU the two fractions sum to the
    configured one, so the pair never takes more than that, whichever loads first; on separate GPUs each gets it.
    """
    if not set(target_device_ids) & set(draft_device_ids):
        return fraction, fraction
    draft = round(fraction * DRAFT_KV_SHARE, 4)
    return round(fraction - draft, 4), draft


def validate_for_trtllm(config: PipelineConfig) -> None:
    """Refuse settings the pinned release silently overrides in ways that break speculative decoding, and what the
    Medusa converter cannot do."""
    kv = config.build.kv_cache
    if not kv.paged:
        raise ConfigError("build.kv_cache.paged: false, but TensorRT-LLM's draft_tokens_external needs the paged KV "
                          "cache (it reuses KV blocks between draft steps); set build.kv_cache.paged: true")
    if config.build.quantization.kv_cache == "int8":
        # tensorrt_llm/builder.py turns use_paged_context_fmha off for an int8 KV cache, which this method needs.
        raise ConfigError("build.quantization.kv_cache: 'int8' makes trtllm-build disable paged context FMHA, which "
                          "draft-target speculative decoding requires; use kv_cache: fp8 or none")
    quant = config.build.quantization
    if is_medusa(config) and (quant.mode != "none" or quant.kv_cache != "none"):
        # examples/medusa/convert_checkpoint.py has quantization flags of its own (SmoothQuant, plain int4, ModelOpt
        # checkpoints), not these modes, and its Qwen2 path ignores them: only unquantized Medusa targets here.
        raise ConfigError(f"build.quantization: mode {quant.mode!r}, kv_cache {quant.kv_cache!r}, but TensorRT-LLM "
                          f"{PINNED_VERSION}'s Medusa converter (examples/{MEDUSA_CONVERTER}) is used unquantized "
                          f"here; set quantization: {{mode: none, kv_cache: none}} or use backend: torch")


# ---- trtllm-build ----------------------------------------------------------------------------------------------------

def build_argv(config: PipelineConfig, role: str, checkpoint_dir: Path, out_dir: Path) -> list[str]:
    """The exact `trtllm-build` argv for one role (same command for every TP/PP size: ranks come from the
    checkpoint's config.json mapping)."""
    validate_for_trtllm(config)
    spec = getattr(config, role)
    build = config.build
    argv = [
        "trtllm-build",
        "--checkpoint_dir", str(checkpoint_dir),
        "--output_dir", str(out_dir),
        "--gemm_plugin", spec.dtype,
        "--kv_cache_type", "paged",
        "--tokens_per_block", str(build.kv_cache.tokens_per_block),
        # Paged context FMHA is what lets the target reuse the KV blocks of the accepted prefix; without
        # context FMHA the builder turns it off, so both are stated rather than left to defaults.
        "--context_fmha", "enable",
        "--use_paged_context_fmha", "enable",
        "--max_batch_size", str(build.max_batch_size),
        "--max_input_len", str(engine_context_len(config)),
        "--max_seq_len", str(build.max_seq_len),
    ]
    if role == "target" and is_medusa(config):
        # The heads are in the checkpoint (MedusaForCausalLM); max_draft_len is the tree's node count, the same
        # value the converter wrote (--max_medusa_token_len), stated rather than left to the checkpoint.
        argv += ["--speculative_decoding_mode", "medusa", "--max_draft_len", str(medusa_nodes(config))]
    elif role == "target":
        argv += ["--speculative_decoding_mode", "draft_tokens_external",
                 "--max_draft_len", str(config.speculative.max_draft_len)]
    if needs_generation_logits(config):
        # build.py in this release logs that the flag is deprecated in favour of the runtime option, but still
        # stores it in the engine, and examples/ngram/run_dtm_ngram.py asserts it on BOTH engines before it
        # passes draft logits; we set it and also ask for logits at run time (belt and braces).
        argv.append("--gather_generation_logits")
    # Never --gather_context_logits: build.py raises when it is combined with --max_draft_len > 0.
    return argv


def engine_context_len(config: PipelineConfig) -> int:
    """The longest context either engine is handed: the draft-target loop submits the whole sequence so far
    (prompt + generated) as a new request every step, so contexts grow to max_seq_len - 1 even though a user's
    prompt is limited to build.max_input_len (which the executor enforces, from engine.json)."""
    return config.build.max_seq_len - 1


def format_argv(argv: list[str]) -> str:
    return shlex.join(argv)


# ---- checkpoint conversion -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ConvertCall:
    """One converter API call: `from_hugging_face` + `save_checkpoint` for one rank, or one `quantize` for all."""

    method: str  # "from_hugging_face" or "quantize"
    rank: int | None  # None when the call writes every rank
    world_size: int
    tp: int
    pp: int
    dtype: str
    quant_algo: str | None
    kv_cache_quant_algo: str | None

    def describe(self, model: str, out_dir: Path, converter: str) -> str:
        quant = (f"QuantConfig(quant_algo={_algo(self.quant_algo)}, "
                 f"kv_cache_quant_algo={_algo(self.kv_cache_quant_algo)})")
        if self.method == "quantize":
            mapping = f"Mapping(world_size={self.world_size}, tp_size={self.tp}, pp_size={self.pp})"
            return (f"{converter}.quantize({model!r}, {str(out_dir)!r}, dtype={self.dtype!r}, "
                    f"mapping={mapping}, quant_config={quant})  # calibrates on a GPU, writes all ranks")
        mapping = f"Mapping(world_size={self.world_size}, rank={self.rank}, tp_size={self.tp}, pp_size={self.pp})"
        return (f"{converter}.from_hugging_face({model!r}, {self.dtype!r}, mapping={mapping}, "
                f"quant_config={quant}).save_checkpoint({str(out_dir)!r}, save_config={self.rank == 0})")


def _algo(name: str | None) -> str:
    return f"QuantAlgo.{name}" if name else "None"


def convert_calls(config: PipelineConfig, role: str) -> list[ConvertCall]:
    validate_for_trtllm(config)
    par = role_parallel(config, role)
    weight_algo, kv_algo = role_quant(config, role)
    dtype = getattr(config, role).dtype
    if weight_algo in CALIBRATED_WEIGHT_ALGOS or kv_algo is not None:
        return [ConvertCall("quantize", None, par.world_size, par.tp, par.pp, dtype, weight_algo, kv_algo)]
    return [ConvertCall("from_hugging_face", rank, par.world_size, par.tp, par.pp, dtype, weight_algo, kv_algo)
            for rank in range(par.world_size)]


# ---- the Medusa converter --------------------------------------------------------------------------------------------

def medusa_converter_script() -> Path:
    return Path(os.environ.get(EXAMPLES_ENV) or CONTAINER_TRTLLM_EXAMPLES) / MEDUSA_CONVERTER


def check_medusa_model_type(model_type: object) -> str:
    if model_type not in MEDUSA_MODEL_TYPES:
        raise CompatibilityError(f"target.model: model_type {model_type!r} has no Medusa converter in TensorRT-LLM "
                                 f"{PINNED_VERSION} (examples/{MEDUSA_CONVERTER} takes "
                                 f"{', '.join(MEDUSA_MODEL_TYPES)}); use backend: torch for Medusa on this model, or "
                                 f"another speculative.method")
    return model_type


def medusa_convert_argv(config: PipelineConfig, model_dir: str, model_type: str, out_dir: Path,
                        script: Path | None = None) -> list[str]:
    """The Medusa converter's argv: the target's HF folder and the heads folder -> one TensorRT-LLM checkpoint
    (MedusaForCausalLM, every rank), run by this interpreter (the one that imports tensorrt_llm). Every count is
    passed: the converter takes the head count from the command line, never from the heads' config.json, and
    defaults it to 4."""
    validate_for_trtllm(config)
    medusa = config.speculative.medusa
    par = role_parallel(config, "target")
    return [sys.executable, str(script or medusa_converter_script()),
            "--model_dir", model_dir, "--medusa_model_dir", str(config.medusa_dir()), "--model_type", model_type,
            "--num_medusa_heads", str(medusa.heads), "--num_medusa_layers", str(medusa.layers),
            "--max_medusa_token_len", str(medusa_nodes(config)),
            "--dtype", config.target.dtype, "--tp_size", str(par.tp), "--pp_size", str(par.pp),
            "--output_dir", str(out_dir)]


# ---- availability ----------------------------------------------------------------------------------------------------

def import_tensorrt_llm(what: str):
    """Import tensorrt_llm or raise BackendUnavailable naming what is missing and how to get it."""
    try:
        import tensorrt_llm
    except ImportError as exc:
        missing = getattr(exc, "name", None) or "tensorrt_llm"
        raise BackendUnavailable(f"{what} needs TensorRT-LLM {PINNED_VERSION}, but `import tensorrt_llm` failed "
                                 f"(missing {missing}); {INSTALL_HINT}") from None
    return tensorrt_llm


def require_cuda_gpu(what: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailable(f"{what} needs an NVIDIA GPU with CUDA, and torch sees none on this machine; "
                                 f"run it on a GPU box, {INSTALL_HINT.removeprefix('run ')}")


def require_trtllm_build() -> str:
    import shutil

    path = shutil.which("trtllm-build")
    if path is None:
        raise BackendUnavailable(f"build needs the `trtllm-build` command of TensorRT-LLM {PINNED_VERSION}, which "
                                 f"is not on PATH; {INSTALL_HINT}")
    return path
