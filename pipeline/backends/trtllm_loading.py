"""Open built TensorRT-LLM engines (a target and its draft, or a target alone): pre-flight checks, then one runner
(trtllm_runner) per engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine_info import EngineInfo, read_draft_engine, read_engine
from ..layout import Layout
from ..methods import Method
from .trtllm_api import TOKENIZER_DIR, import_tensorrt_llm, kv_cache_fractions, medusa_choices, require_cuda_gpu
from .trtllm_runner import EngineLimits, ModelRunnerEngine
from .trtllm_preflight import (check_context_logits, check_medusa_mode, check_target_spec_mode, check_version,
                               preflight, raise_if_problems, read_engine_config)

__all__ = ["TOKENIZER_DIR", "preflight_pair", "open_engines", "OpenedEngines"]


def preflight_pair(root: Path, installed_version: str | None, target_device_ids: list[int] | None = None,
                   draft_device_ids: list[int] | None = None) -> tuple[EngineInfo, EngineInfo]:
    """engine.json of a built target and draft, once every pre-flight check on the pair passed (raises EngineError
    otherwise)."""
    layout = Layout(Path(root))
    target = read_engine(layout.root, "target")
    draft = read_draft_engine(layout.root, target)
    target_cfg = read_engine_config(layout.engine_dir("target"))
    draft_cfg = read_engine_config(layout.engine_dir("draft"))
    raise_if_problems(preflight(
        target_cfg, draft_cfg, max_draft_len=target.max_draft_len, acceptance=target.acceptance,
        installed_version=installed_version, tokenizer_len=target.get("tokenizer_len"),
        target_device_ids=target_device_ids or target.get("target_device_ids"),
        draft_device_ids=draft_device_ids or target.get("draft_device_ids")))
    return target, draft


def preflight_target(root: Path, installed_version: str | None) -> EngineInfo:
    """engine.json of a target opened without a draft (speculative.method ngram or medusa), once its pre-flight
    checks passed."""
    layout = Layout(Path(root))
    target = read_engine(layout.root, "target")
    engine = read_engine_config(layout.engine_dir("target"))
    if target.medusa_choices:
        mode = check_medusa_mode(engine, len(medusa_choices(target.medusa_choices)))
    else:
        mode = check_target_spec_mode(engine, target.max_draft_len)
    raise_if_problems(mode + check_context_logits(engine) + check_version(engine, installed_version))
    return target


@dataclass
class OpenedEngines:
    """What the executor needs from a checked engine folder."""

    target: ModelRunnerEngine
    draft: ModelRunnerEngine | None  # None for an ngram build
    tokenizer: Any
    limits: EngineLimits
    acceptance: str
    eos_token_ids: list[int]
    medusa_choices: list[list[int]] | None = None  # the tree a Medusa target verifies (None: another method)


def open_engines(root, method: Method, target_device_ids: list[int] | None = None,
                 draft_device_ids: list[int] | None = None) -> OpenedEngines:
    """The runners on the engines under ``root``; device ids default to the runtime.* recorded at build time.
    A method without a draft model opens only the target engine."""
    layout = Layout(Path(root))
    trtllm = import_tensorrt_llm("running TensorRT-LLM engines")
    require_cuda_gpu("running TensorRT-LLM engines")
    if not method.needs_draft_model:
        target_info = preflight_target(layout.root, trtllm.__version__)
    else:
        target_info, _ = preflight_pair(layout.root, trtllm.__version__, target_device_ids, draft_device_ids)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(layout.engine_dir("target") / TOKENIZER_DIR)
    tree = medusa_choices(target_info.medusa_choices) if target_info.medusa_choices else None
    # Draft logits come from a draft engine; a Medusa engine drafts inside and was built without them.
    rejection = target_info.acceptance == "rejection" and tree is None
    target_ids = target_device_ids or target_info.get("target_device_ids")
    draft_ids = draft_device_ids or target_info.get("draft_device_ids")
    fraction = target_info.get("kv_cache_free_gpu_mem_fraction")
    # On a shared GPU the two fractions sum to the configured one (the same split the Triton repository uses);
    # without a draft engine the target takes all of it.
    target_kv, draft_kv = kv_cache_fractions(fraction, target_ids, draft_ids) if method.needs_draft_model \
        else (fraction, 0.0)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    reuse = target_info.get("enable_block_reuse")
    # Every step re-submits the sequence so far: allow contexts up to max_seq_len - 1, as the engines were built.
    context_len = target_info.max_seq_len - 1
    draft = ModelRunnerEngine(layout.engine_dir("draft"), draft_ids, draft_kv, reuse, rejection, eos, pad,
                              context_len) if method.needs_draft_model else None
    target = ModelRunnerEngine(layout.engine_dir("target"), target_ids, target_kv, reuse, rejection, eos, pad,
                               context_len, medusa_choices=tree)
    limits = EngineLimits(target_info.max_input_len, target_info.max_seq_len,
                          engine_draft_len=target_info.max_draft_len)
    return OpenedEngines(target, draft, tokenizer, limits, target_info.acceptance, [eos] if eos is not None else [],
                         tree)
