"""One generation request as a plain object: its prompt, parameters, random stream and progress.

Both executors (torch and trtllm) build requests here and feed each target step's tokens to
:meth:`SpecRequest.advance`, which owns everything that is not backend-specific: the K to draft next (fixed or
dynamic), the stop/EOS cut, the exact ``max_new_tokens`` limit, acceptance statistics and the UTF-8-safe text delta.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..methods import GRAMMAR_PROPOSER, Method
from ..speculative import SamplingParams
from ..speculative.sampling_params import LogitsAdjust
from .acceptance import PROPOSER_PRIOR, AcceptanceEstimate
from .request_values import DraftPlan
from .results import GenerationResult, GenerationStats, RequestFailed, StreamEvent, TokenLogprob

_ids = itertools.count()

def next_draft_len(current: int, drafted: int, accepted: int, max_draft_len: int) -> int:
    """Dynamic K: lengthen after a fully accepted step, shorten after a rejection (within 1..max_draft_len).

    Drafting past the first rejection is wasted draft time, and a run of full acceptances means the draft is
    tracking the target well; the additive rule follows acceptance within a few steps without overshooting.
    """
    if accepted == drafted:
        return min(max_draft_len, current + 1)
    return max(1, current - 1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own random stream (``seed`` already validated): its samples never depend on other requests."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


@dataclass(eq=False)
class SpecRequest:
    """A request and its state. Created by ``ExecutorBase.new_request``; advanced one target step at a time."""

    prompt_ids: list[int]  # [prompt_len] the prompt's token ids
    max_new_tokens: int
    params: SamplingParams
    plan: DraftPlan
    generator: torch.Generator
    seeded: bool  # a seed was given: the sampled output must be reproducible, so K never adapts to the batch
    stop_ids: frozenset[int]  # EOS ids plus the request's stop tokens
    eos_ids: frozenset[int]
    decode: object = None  # callable(list[int]) -> str, or None when no text is wanted per step
    seed: int | None = None  # as given (the generator already holds it; engines that take seeds read it here)
    method: Method = Method.DRAFT_MODEL  # who proposes (ngram+draft: chosen per step)
    cache_salt: str | None = None  # prefix reuse only among requests with the same salt (None: among unsalted ones)
    adjust: LogitsAdjust = LogitsAdjust()  # penalties, bias and min_tokens on the target's (and draft's) logits
    grammar: object = None  # a GrammarMatcher (pipeline.speculative.grammar) constraining the output, or None
    logprobs: int | None = None  # None: no log-probabilities; n >= 0: each token's, with the n likeliest beside it
    id: int = field(default_factory=lambda: next(_ids))
    generated: list[int] = field(default_factory=list)  # tokens emitted so far (no prompt)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token, when asked for
    stats: GenerationStats = field(default_factory=GenerationStats)
    finish_reason: str | None = None  # "eos" | "stop" | "length" | "cancelled" | "error"
    dynamic_draft_len: int = 0  # dynamic K's current value (the step_draft_len before caps), 1..max_draft_len
    # proposer -> this request's acceptance with it (what ngram+draft chooses by)
    _acceptance: dict[Method, AcceptanceEstimate] = field(default_factory=dict)
    _text_sent: str = ""

    def __post_init__(self):
        self.dynamic_draft_len = self.plan.max_draft_len

    # ---- what the next step may do ------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.generated

    def step_draft_len(self, cap: int | None = None) -> int:
        """The next step's K: the request's own (dynamic or fixed), never more than can be emitted (a step emits up
        to K + 1 tokens), and within ``cap`` when the engine's policy chose a lower K for it. The cap is ignored when
        the caller named K, and by a seeded sampling request: its random draws, hence its tokens, depend on the K
        it drafts, and a seeded result must not depend on the batch it ran in."""
        k = self.dynamic_draft_len if self.plan.dynamic else self.plan.max_draft_len
        if cap is not None and not self.plan.explicit and not (self.seeded and not self.params.greedy):
            k = min(k, cap)
        return max(0, min(k, self.remaining - 1))

    def acceptance(self, proposer: Method) -> AcceptanceEstimate:
        """This request's recent acceptance with ``proposer`` (a prior until it drafted with it)."""
        if proposer not in self._acceptance:
            self._acceptance[proposer] = AcceptanceEstimate.starting_at(PROPOSER_PRIOR[proposer])
        return self._acceptance[proposer]

    # ---- one step's outcome --------------------------------------------------------------------------------------

    def advance(self, new_tokens: Sequence[int], drafted: int, accepted: int, plain_run: bool = False,
                proposer: Method | str | None = None, logprobs: list[TokenLogprob] | None = None) -> StreamEvent:
        """Record one target step that emitted ``new_tokens`` (accepted draft tokens + one target token).

        ``plain_run``: the tokens come from plain decoding, one target step each (an engine that decoded several
        tokens in one call); they are emitted as one event. ``logprobs``: one per new token, when the request asked
        for them; cut with the tokens. A grammar, when the request has one, consumes the tokens kept."""
        tokens = list(new_tokens)[:self.remaining]
        reason = None
        for i, token in enumerate(tokens):
            if token in self.stop_ids:
                tokens = tokens[:i + 1]  # the stop token is emitted; nothing after it
                reason = "eos" if token in self.eos_ids else "stop"
                break
        for _ in range(len(tokens) if plain_run else 1):
            self.stats.record_step(drafted, accepted, proposer)
        if proposer is not None and drafted > 0:
            self.acceptance(proposer).observe(drafted, accepted)
        if self.plan.dynamic and drafted > 0 and proposer != GRAMMAR_PROPOSER:  # forced tokens say nothing of the method
            self.dynamic_draft_len = next_draft_len(self.dynamic_draft_len, drafted, accepted, self.plan.max_draft_len)
        if self.grammar is not None:
            self.grammar.consume(tokens)
        self.generated.extend(tokens)
        kept_logprobs = list(logprobs[:len(tokens)]) if logprobs is not None else None
        if kept_logprobs is not None:
            self.token_logprobs.extend(kept_logprobs)
        self.stats.generated_tokens = len(self.generated)
        if reason is None and (self.remaining <= 0 or not tokens):
            reason = "length"
        self.finish_reason = reason
        return StreamEvent(tokens, self._text_delta(), reason is not None, reason, self.stats,
                           logprobs=kept_logprobs)

    def cancel(self) -> StreamEvent:
        """Finish now (the client went away); the event carries no tokens."""
        self.finish_reason = "cancelled"
        return StreamEvent([], "", True, "cancelled", self.stats)

    def fail(self, error: RequestFailed) -> StreamEvent:
        """Finish now: the engine failed this request alone; the event carries ``error`` and no tokens."""
        self.finish_reason = "error"
        return StreamEvent([], "", True, "error", self.stats, error=error)

    def _text_delta(self) -> str:
        if self.decode is None:  # decoding the whole text each step is O(n^2): only streams need it
            return ""
        text = self.decode(self.generated)
        # Hold back a trailing partial UTF-8 character until the next step completes it.
        stable = text if self.finished or not text.endswith("\ufffd") else text[:len(self._text_sent)]
        delta, self._text_sent = stable[len(self._text_sent):], stable
        return delta

    def result(self, text_of) -> GenerationResult:
        return GenerationResult(list(self.generated), text_of(self.generated), self.stats,
                                self.finish_reason or "length", prompt_tokens=len(self.prompt_ids),
                                logprobs=list(self.token_logprobs) if self.logprobs is not None else None)
