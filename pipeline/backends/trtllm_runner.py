"""The TensorRT-LLM boundary: one engine that generates for one sequence, and the real runner behind it.

The executor (pipeline.executor.trtllm_executor) speaks only these types; tests put a fake (named as such) behind
the :class:`TrtllmRunner` protocol. :class:`ModelRunnerEngine` is the only class that calls tensorrt_llm's runtime
(imported lazily, so this module loads without it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class Sampling:
    """One engine call's sampling settings (the request's, already checked) and its seed."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class RunnerOutput:
    token_ids: list[int]  # generated tokens only, after the prompt
    logits: Any = None  # [len(token_ids), vocab] generation logits when asked for, else None


class TrtllmRunner(Protocol):
    vocab_size: int

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: Sampling, *,
                 draft_tokens: list[int] | None = None, draft_logits: Any = None,
                 want_logits: bool = False) -> RunnerOutput: ...


@dataclass(frozen=True)
class EngineLimits:
    """What a built target takes: engine.json's max_input_len, max_seq_len and max_draft_len."""

    max_input_len: int
    max_seq_len: int
    engine_draft_len: int  # K the target engine was built for (engine.json's max_draft_len)


class ModelRunnerEngine:
    """TrtllmRunner over tensorrt_llm.runtime.ModelRunnerCpp (the pinned release's C++ executor wrapper)."""

    def __init__(self, engine_dir: Path, device_ids: list[int], kv_fraction: float, block_reuse: bool,
                 gather_generation_logits: bool, end_id: int | None, pad_id: int | None,
                 max_context_len: int | None = None, medusa_choices: list[list[int]] | None = None):
        """``medusa_choices``: the tree a Medusa engine verifies (every node's rank path); None for other engines
        (and for a Medusa engine, TensorRT-LLM's default mc_sim_7b_63)."""
        from tensorrt_llm.runtime import ModelRunnerCpp

        # Orchestrator mode spawns the executor's worker processes on device_ids, so a TP=4 target and a TP=1
        # draft run side by side from one Python process without mpirun (as run_dtm_ngram.py does).
        self.runner = ModelRunnerCpp.from_dir(
            engine_dir=str(engine_dir), device_ids=list(device_ids), is_orchestrator_mode=True,
            kv_cache_free_gpu_memory_fraction=kv_fraction, kv_cache_enable_block_reuse=block_reuse,
            gather_generation_logits=gather_generation_logits, max_input_len=max_context_len,
            medusa_choices=medusa_choices)
        self.vocab_size = int(self.runner.vocab_size_padded)
        self.end_id, self.pad_id = end_id, pad_id

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: Sampling, *,
                 draft_tokens: list[int] | None = None, draft_logits: Any = None,
                 want_logits: bool = False) -> RunnerOutput:
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
        return RunnerOutput(tokens, logits)
