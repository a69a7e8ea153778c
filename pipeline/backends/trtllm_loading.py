"""Open a pair of built TensorRT-LLM engines: pre-flight checks, then one ModelRunnerCpp per engine.

The only module that touches tensorrt_llm's runtime API (imported lazily, inside functions).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import EngineError
from ..executor.loading import EngineInfo, read_engine
from ..executor.trtllm_executor import EngineLimits, EngineOutput, Sampling
from ..layout import Layout
from .trtllm_api import TOKENIZER_DIR, import_tensorrt_llm, kv_cache_fractions, require_cuda_gpu
from .trtllm_preflight import (check_context_logits, check_target_spec_mode, check_version, preflight,
                               raise_if_problems, read_engine_config)

__all__ = ["TOKENIZER_DIR", "check_pair", "load_executor", "ModelRunnerEngine"]


def check_pair(root: Path, installed_version: str | None, target_device_ids: list[int] | None = None,
               draft_device_ids: list[int] | None = None) -> tuple[EngineInfo, EngineInfo]:
    """engine.json of target and draft after every pre-flight check passed (raises EngineError otherwise)."""
    layout = Layout(Path(root))
    target, draft = read_engine(layout.root, "target"), read_engine(layout.root, "draft")
    if target.config_name != draft.config_name:
        raise EngineError(f"{layout.root}: target engine was built for config {target.config_name!r} but the "
                          f"draft for {draft.config_name!r}; rebuild both with one config")
    target_cfg = read_engine_config(layout.engine_dir("target"))
    draft_cfg = read_engine_config(layout.engine_dir("draft"))
    raise_if_problems(preflight(
        target_cfg, draft_cfg, max_draft_len=target.max_draft_len, acceptance=target.acceptance,
        installed_version=installed_version, tokenizer_len=target.get("tokenizer_len"),
        target_device_ids=target_device_ids or target.get("target_device_ids"),
        draft_device_ids=draft_device_ids or target.get("draft_device_ids")))
    return target, draft


def check_target_only(root: Path, installed_version: str | None) -> EngineInfo:
    """engine.json of a target built without a draft (speculative.method: ngram) after its pre-flight checks."""
    layout = Layout(Path(root))
    target = read_engine(layout.root, "target")
    engine = read_engine_config(layout.engine_dir("target"))
    raise_if_problems(check_target_spec_mode(engine, target.max_draft_len) + check_context_logits(engine)
                      + check_version(engine, installed_version))
    return target


def load_executor(cls, root, target_device_ids: list[int] | None = None,
                  draft_device_ids: list[int] | None = None, method: str = "draft_model") -> Any:
    """The executor on the engines under ``root``; device ids default to the runtime.* recorded at build time.
    With ``method="ngram"`` only the target engine is loaded (lookups need no draft)."""
    layout = Layout(Path(root))
    trtllm = import_tensorrt_llm("running TensorRT-LLM engines")
    require_cuda_gpu("running TensorRT-LLM engines")
    if method == "ngram":
        target_info = check_target_only(layout.root, trtllm.__version__)
    else:
        target_info, _ = check_pair(layout.root, trtllm.__version__, target_device_ids, draft_device_ids)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(layout.engine_dir("target") / TOKENIZER_DIR)
    rejection = target_info.acceptance == "rejection"
    target_ids = target_device_ids or target_info.get("target_device_ids")
    draft_ids = draft_device_ids or target_info.get("draft_device_ids")
    # On a shared GPU the two fractions sum to the configured one (the same split the Triton repository uses).
    target_kv, draft_kv = kv_cache_fractions(target_info.get("kv_cache_free_gpu_mem_fraction"), target_ids,
                                             draft_ids)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    reuse = target_info.get("enable_block_reuse")
    # Every step re-submits the sequence so far: allow contexts up to max_seq_len - 1, as the engines were built.
    context_len = target_info.max_seq_len - 1
    draft = None if method == "ngram" else ModelRunnerEngine(
        layout.engine_dir("draft"), draft_ids, draft_kv, reuse, rejection, eos, pad, context_len)
    target = ModelRunnerEngine(layout.engine_dir("target"), target_ids, target_kv, reuse, rejection, eos, pad,
                               context_len)
    limits = EngineLimits(target_info.max_input_len, target_info.max_seq_len, target_info.max_draft_len)
    return cls(target, draft, tokenizer, limits, target_info.max_draft_len, target_info.acceptance,
               eos_token_ids=[eos] if eos is not None else [], method=method)


class ModelRunnerEngine:
    """EngineRunner over tensorrt_llm.runtime.ModelRunnerCpp (the pinned release's C++ executor wrapper)."""

    def __init__(self, engine_dir: Path, device_ids: list[int], kv_fraction: float, block_reuse: bool,
                 gather_generation_logits: bool, end_id: int | None, pad_id: int | None,
                 max_context_len: int | None = None):
        from tensorrt_llm.runtime import ModelRunnerCpp

        # Orchestrator mode spawns the executor's worker processes on device_ids, so a TP=4 target and a TP=1
        # draft run side by side from one Python process without mpirun (as run_dtm_ngram.py does).
        self.runner = ModelRunnerCpp.from_dir(
            engine_dir=str(engine_dir), device_ids=list(device_ids), is_orchestrator_mode=True,
            kv_cache_free_gpu_memory_fraction=kv_fraction, kv_cache_enable_block_reuse=block_reuse,
            gather_generation_logits=gather_generation_logits, max_input_len=max_context_len)
        self.vocab_size = int(self.runner.vocab_size_padded)
        self.end_id, self.pad_id = end_id, pad_id

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: Sampling, *,
                 draft_tokens: list[int] | None = None, draft_logits: Any = None,
                 want_logits: bool = False) -> EngineOutput:
        import torch

        kwargs: dict[str, Any] = {}
        if draft_tokens:
            kwargs["draft_tokens_list"] = [draft_tokens]
            if draft_logits is not None:
                kwargs["draft_logits_list"] = [draft_logits]
        greedy = sampling.temperature == 0
        out = self.runner.generate(
            [torch.tensor(prompt, dtype=torch.int32)], max_new_tokens=max_new_tokens, end_id=self.end_id,
            pad_id=self.pad_id, temperature=1.0 if greedy else sampling.temperature,
            top_k=1 if greedy else sampling.top_k, top_p=1.0 if greedy else sampling.top_p,
            random_seed=sampling.seed, return_dict=True, output_sequence_lengths=True,
            output_generation_logits=want_logits, **kwargs)
        end = int(out["sequence_lengths"][0][0])
        tokens = out["output_ids"][0][0][len(prompt):end].tolist()
        logits = out["generation_logits"][0][0][:len(tokens)] if want_logits else None  # [n, vocab]
        return EngineOutput(tokens, logits)
