"""Draft-and-verify decoding on two TensorRT-LLM engines, behind the same contract as the torch executor.

Per target step (one request):
  1. Draft: the draft engine generates K tokens (and, for rejection sampling, their generation logits).
  2. Verify: the target engine gets the sequence plus the K draft tokens as an ExternalDraftTokensConfig
     (via ModelRunnerCpp.generate(draft_tokens_list=..., draft_logits_list=...)) and, inside its compiled graph,
     keeps the accepted prefix and adds one recovered or bonus token: output = accepted + 1 token.
  3. Both engines see the grown sequence as a new request next step; KV-cache block reuse makes the shared
     prefix free, which is why the pinned release requires paged context FMHA and block reuse for this method.
Prompt handling, K (fixed or "auto"), request checks, stops, UTF-8 deltas and statistics come from ExecutorBase and
SpecRequest, shared with the torch executor. The engine boundary is :class:`EngineRunner`; the real one is
pipeline.backends.trtllm_loading.ModelRunnerEngine, tests substitute a fake (named as such).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

import time

from .base import ExecutorBase
from .proposers import DRAFT, NgramSettings, check_method, choose_proposal
from .request import SpecRequest
from .results import StreamEvent, checked_sampling

SEED_STRIDE = 0x9E3779B97F4A7C15  # odd 64-bit constant (golden ratio): step seeds of nearby request seeds differ


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        checked_sampling(self.temperature, self.top_k, self.top_p)  # same rules and messages as the torch path


def step_seed(seed: int, step: int, role: int) -> int:
    """A distinct 64-bit seed for each engine call of a request.

    The C++ runtime restarts its random stream from ``random_seed`` on every request it is given, and this loop
    gives it a new request every step: one seed for all of them would replay the same uniforms each step.
    """
    return (seed + (2 * step + role + 1) * SEED_STRIDE) % (1 << 64)


@dataclass
class EngineOutput:
    token_ids: list[int]  # generated tokens only, after the prompt
    logits: Any = None  # [len(token_ids), vocab] generation logits when asked for, else None


class EngineRunner(Protocol):
    """The TensorRT-LLM boundary: one engine that generates for one sequence."""

    vocab_size: int

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: Sampling, *,
                 draft_tokens: list[int] | None = None, draft_logits: Any = None,
                 want_logits: bool = False) -> EngineOutput: ...


@dataclass(frozen=True)
class EngineLimits:
    max_input_len: int
    max_seq_len: int
    max_draft_len: int  # K the target engine was built for


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class TrtllmSpeculativeExecutor(ExecutorBase):
    """generate()/generate_stream()/run() of ExecutorBase over two TensorRT-LLM engines."""

    def __init__(self, target: EngineRunner, draft: EngineRunner | None, tokenizer, limits: EngineLimits,
                 max_draft_len: int, acceptance: str = "rejection", eos_token_ids: Sequence[int] = (),
                 method: str = "draft_model", ngram: NgramSettings | None = None):
        """``method``: "draft_model", "ngram" (lookups fed to the target as external draft tokens, as TensorRT-LLM's
        examples/ngram does; ``draft`` may be None) or "ngram+draft" (per step, the better of the two)."""
        if acceptance not in ("rejection", "greedy"):
            raise ValueError(f"acceptance: {acceptance!r} must be 'rejection' or 'greedy'")
        check_method(method, draft is not None)
        self.method = method
        self.ngram = ngram or NgramSettings()
        self._seconds = {"draft": 0.0, "target": 0.0}  # mean seconds per draft token / per verify call
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.limits = limits
        self.max_draft_len = max_draft_len
        self.acceptance = acceptance
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.max_input_len = limits.max_input_len
        self.max_seq_len = limits.max_seq_len
        self.draft_len_limit = limits.max_draft_len

    @property
    def has_draft_model(self) -> bool:
        return self.draft is not None

    @property
    def cost_ratio(self) -> float:
        draft, target = self._seconds["draft"], self._seconds["target"]
        return draft / target if draft > 0 and target > 0 else 0.25

    def _timed(self, role: str, per: int, call):
        start = time.perf_counter()
        out = call()
        seconds = (time.perf_counter() - start) / max(per, 1)
        mean = self._seconds[role]
        self._seconds[role] = seconds if mean == 0 else 0.9 * mean + 0.1 * seconds
        return out

    @classmethod
    def from_engines(cls, root, target_device_ids: list[int] | None = None,
                     draft_device_ids: list[int] | None = None, method: str = "draft_model",
                     ngram: NgramSettings | None = None) -> TrtllmSpeculativeExecutor:
        """Load engines/<name> built by the trtllm backend (target/build and draft/build).

        GPUs default to runtime.target_device_ids / runtime.draft_device_ids as recorded in engine.json at build
        time; pass them to override (runtime settings do not invalidate a build).
        """
        from ..backends.trtllm_loading import load_executor

        executor = load_executor(cls, root, target_device_ids, draft_device_ids, method=method)
        executor.ngram = ngram or executor.ngram
        return executor

    # ---- the contract's backend part ------------------------------------------------------------------------------

    def _run(self, requests: list[SpecRequest]) -> Iterator[tuple[SpecRequest, StreamEvent]]:
        """One request after another; each engine call is itself in-flight batched by TensorRT-LLM's executor."""
        for request in requests:
            seed = request.seed if request.seed is not None else int(
                torch.randint(0, 2 ** 62, (1,), generator=request.generator))
            while not request.finished:
                k = request.draft_len()
                step = request.stats.target_steps
                if k == 0 and request.plan.k_max == 0:
                    yield request, self._target_only(request, seed)
                    continue
                tokens, drafted, accepted, proposer = self._step(request, k, seed, step)
                yield request, request.advance(tokens, drafted, accepted, proposer=proposer)

    def _sampling(self, request: SpecRequest, seed: int, step: int, role: int) -> Sampling:
        p = request.params
        return Sampling(p.temperature, p.top_k, p.top_p, step_seed(seed, step, role))

    def _step(self, request: SpecRequest, k: int, seed: int, step: int) -> tuple[list[int], int, int, str | None]:
        """One draft-and-verify step; returns (tokens to append, draft tokens proposed, draft tokens accepted,
        the proposer)."""
        seq = request.sequence
        use_logits = self.acceptance == "rejection" and request.params.temperature > 0
        proposer, draft_tokens = choose_proposal(request, k, self.ngram, self.cost_ratio)
        draft_logits = None
        if proposer == DRAFT:
            # Step 1: the draft proposes k tokens (it may stop early on EOS).
            out = self._timed("draft", k, lambda: self.draft.generate(
                seq, k, self._sampling(request, seed, step, 0), want_logits=use_logits))
            draft_tokens = out.token_ids[:k]
            if use_logits and draft_tokens:
                draft_logits = self._fit_logits(out.logits[:len(draft_tokens)])
        # (A lookup has no logits: the target then verifies it by token comparison, which is lossless too.)
        # Step 2: the target verifies all draft tokens in one pass and adds one token of its own.
        verified = self._timed("target", 1, lambda: self.target.generate(
            seq, len(draft_tokens) + 1, self._sampling(request, seed, step, 1),
            draft_tokens=draft_tokens or None, draft_logits=draft_logits))
        new_tokens = verified.token_ids[:len(draft_tokens) + 1]
        # A recovered token never equals the rejected draft token, so the matching prefix is the accepted count.
        accepted = min(common_prefix(new_tokens, draft_tokens), len(draft_tokens))
        return new_tokens, len(draft_tokens), accepted, proposer if draft_tokens else None

    def _target_only(self, request: SpecRequest, seed: int) -> StreamEvent:
        """K = 0 for the whole request: one engine call generates everything (the engine decodes in-flight)."""
        step = request.stats.target_steps
        out = self.target.generate(request.sequence, request.remaining, self._sampling(request, seed, step, 1))
        event = request.advance(out.token_ids, 0, 0, plain_run=True)
        if not event.finished:  # the engine stopped early (its end id): nothing more will come
            request.finish_reason = event.finish_reason = "length"
            event.finished = True
        return event

    def _fit_logits(self, logits):
        """Draft logits padded/trimmed to the target's width; extra rows are padding, never real tokens."""
        width = self.target.vocab_size
        have = logits.shape[-1]
        if have == width:
            return logits
        if have > width:
            return logits[..., :width]
        pad = torch.full((*logits.shape[:-1], width - have), float("-inf"), dtype=logits.dtype,
                         device=logits.device)
        return torch.cat([logits, pad], dim=-1)
