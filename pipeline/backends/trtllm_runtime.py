"""Draft-and-verify decoding on two TensorRT-LLM engines.

Per target step (one sequence):
  1. Draft: the draft engine generates K tokens (and, for rejection sampling, their generation logits).
  2. Verify: the target engine gets the sequence plus the K draft tokens as an ExternalDraftTokensConfig
     (via ModelRunnerCpp.generate(draft_tokens_list=..., draft_logits_list=...)) and, inside its compiled graph,
     keeps the accepted prefix and adds one recovered or bonus token: output = accepted + 1 token.
  3. Both engines see the grown sequence as a new request next step; KV-cache block reuse makes the shared
     prefix free, which is why the pinned release requires paged context FMHA and block reuse for this method.
The loop mirrors examples/ngram/run_dtm_ngram.py of the pinned release (our code, not a copy).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..executor.limits import check_request
from ..executor.text import Prompt, TokenizerIO
from ..executor.results import (GenerationResult, GenerationStats, RequestError, StreamEvent, checked_sampling,
                                collect_result)



@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        checked_sampling(self.temperature, self.top_k, self.top_p)  # same rules and messages as the torch path


@dataclass
class EngineOutput:
    token_ids: list[int]  # generated tokens only, after the prompt
    logits: Any = None  # [len(token_ids), vocab] generation logits when asked for, else None


class EngineRunner(Protocol):
    """The TensorRT-LLM boundary: one engine that generates for one sequence. Tests substitute a fake here."""

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


class TrtllmSpeculativeExecutor(TokenizerIO):
    """Same generate()/generate_stream() contract as pipeline.executor.SpeculativeExecutor."""

    def __init__(self, target: EngineRunner, draft: EngineRunner | None, tokenizer, limits: EngineLimits,
                 max_draft_len: int, acceptance: str = "rejection", eos_token_ids: Sequence[int] = ()):
        if acceptance not in ("rejection", "greedy"):
            raise ValueError(f"acceptance: {acceptance!r} must be 'rejection' or 'greedy'")
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.limits = limits
        self.max_draft_len = max_draft_len
        self.acceptance = acceptance
        self.eos_token_ids = sorted(set(eos_token_ids))

    @classmethod
    def from_engines(cls, root, target_device_ids: list[int] | None = None,
                     draft_device_ids: list[int] | None = None) -> TrtllmSpeculativeExecutor:
        """Load engines/<name> built by the trtllm backend (target/build and draft/build).

        GPUs default to runtime.target_device_ids / runtime.draft_device_ids as recorded in engine.json at build
        time; pass them to override (runtime settings do not invalidate a build).
        """
        from .trtllm_loading import load_executor

        return load_executor(cls, root, target_device_ids, draft_device_ids)

    # ---- public API -------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, max_draft_len: int | None = None
                 ) -> list[GenerationResult]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise RequestError("prompts: pass a list of prompts (strings or token-id lists), not a single prompt")
        token_lists = [self.encode(prompt) for prompt in prompts]  # once: generate_stream takes ids as they are
        return [collect_result(self.generate_stream(ids, max_new_tokens, temperature, top_k, top_p, seed,
                                                    max_draft_len), self.decode, len(ids))
                for ids in token_lists]

    def generate_stream(self, prompt: Prompt, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                        top_p: float = 1.0, seed: int | None = None, max_draft_len: int | None = None
                        ) -> Iterator[StreamEvent]:
        """Yield the tokens of each target step as soon as the target has verified them."""
        sampling = Sampling(float(temperature), int(top_k), float(top_p), seed)
        k_max = self.max_draft_len if max_draft_len is None else int(max_draft_len)
        seq = self.encode(prompt)
        self._validate(seq, int(max_new_tokens), k_max)
        if k_max == 0:
            yield from self._target_only(seq, max_new_tokens, sampling)
            return
        stats = GenerationStats()
        generated: list[int] = []
        text = ""
        while len(generated) < max_new_tokens:
            k = min(k_max, max_new_tokens - len(generated) - 1)  # a step emits up to k + 1 tokens
            new_tokens, drafted, accepted = self._step(seq, k, sampling)
            stats.record_step(drafted, accepted)
            event, text = self._emit(new_tokens, generated, seq, max_new_tokens, stats, text)
            yield event
            if event.finished:
                return

    # ---- the loop ---------------------------------------------------------------------------------------------

    def _step(self, seq: list[int], k: int, sampling: Sampling) -> tuple[list[int], int, int]:
        """One draft-and-verify step; returns (tokens to append, draft tokens proposed, draft tokens accepted)."""
        use_logits = self.acceptance == "rejection" and sampling.temperature > 0
        draft_tokens: list[int] = []
        draft_logits = None
        if k > 0:
            # Step 1: the draft proposes k tokens (it may stop early on EOS).
            out = self.draft.generate(seq, k, sampling, want_logits=use_logits)
            draft_tokens = out.token_ids[:k]
            if use_logits and draft_tokens:
                draft_logits = self._fit_logits(out.logits[:len(draft_tokens)])
        # Step 2: the target verifies all draft tokens in one pass and adds one token of its own.
        verified = self.target.generate(seq, len(draft_tokens) + 1, sampling, draft_tokens=draft_tokens or None,
                                        draft_logits=draft_logits)
        new_tokens = verified.token_ids[:len(draft_tokens) + 1]
        # A recovered token never equals the rejected draft token, so the matching prefix is the accepted count.
        accepted = min(common_prefix(new_tokens, draft_tokens), len(draft_tokens))
        return new_tokens, len(draft_tokens), accepted

    def _fit_logits(self, logits):
        """Draft logits padded/trimmed to the target's width; extra rows are padding, never real tokens."""
        import torch

        width = self.target.vocab_size
        have = logits.shape[-1]
        if have == width:
            return logits
        if have > width:
            return logits[..., :width]
        pad = torch.full((*logits.shape[:-1], width - have), float("-inf"), dtype=logits.dtype,
                         device=logits.device)
        return torch.cat([logits, pad], dim=-1)

    def _target_only(self, seq: list[int], max_new_tokens: int, sampling: Sampling) -> Iterator[StreamEvent]:
        stats = GenerationStats()
        if max_new_tokens <= 0:
            return
        out = self.target.generate(seq, max_new_tokens, sampling)
        for _ in out.token_ids:
            stats.record_step(0, 0)  # plain decoding: one target step per token
        yield self._emit(out.token_ids[:max_new_tokens], [], seq, max_new_tokens, stats, "", force_final=True)[0]

    def _emit(self, new_tokens: list[int], generated: list[int], seq: list[int], max_new_tokens: int,
              stats: GenerationStats, text_before: str, force_final: bool = False) -> tuple[StreamEvent, str]:
        """The event for one step's tokens and the decoded text so far (passed back in, so each step decodes once)."""
        reason = None
        for i, token in enumerate(new_tokens):
            if token in self.eos_token_ids:
                new_tokens, reason = new_tokens[:i + 1], "eos"  # the EOS is emitted; nothing after it
                break
        seq.extend(new_tokens)
        generated.extend(new_tokens)
        stats.generated_tokens = len(generated)
        if reason is None and (len(generated) >= max_new_tokens or force_final or not new_tokens):
            reason = "length"
        text = self.decode(generated)
        return StreamEvent(new_tokens, text[len(text_before):], reason is not None, reason, stats), text

    def _validate(self, prompt_ids: list[int], max_new_tokens: int, k: int) -> None:
        check_request(prompt_ids, max_new_tokens, k, has_draft=self.draft is not None,
                      draft_len_limit=self.limits.max_draft_len, max_input_len=self.limits.max_input_len,
                      max_seq_len=self.limits.max_seq_len)
