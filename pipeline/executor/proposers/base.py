"""The proposer interface: who drafts a row's tokens in one engine step.

The engine asks proposers two things per step:
  limit   the most tokens one could propose for a row at the row's K (the K policy prices the verify with it; the
          proposer of the row's method is asked, and the chosen one drafts only a row it can propose for: limit > 0);
  propose draft for all the rows handed to it at once (one batched forward for a model), writing each row's tokens
          and, for sampled rows, their distributions into the StepBatch.
Which proposer drafts a row is decided in one place for both executors, dispatch.choose_drafter (a chooser such as
ngram+draft hands the row to the lookup or the draft model).
The verifier never learns who drafted: it sees draft tokens and distributions, or a tree of candidates (Medusa).

A proposer that keeps KV of its own per request (a draft model) names the runner holding it, ``kv_runner``: a
BatchModelRunner whose cache follows the target's block tables (PagedKVCache.companion), so its KV lives in the
target's block pool under the same memory limit. The engine then runs the request's sequence there through its
whole life beside the target's: opened when the prompt's prefill starts (reusing the prefix blocks it filled
before), brought up to the target's length after each prompt chunk (``catch_up``, the proposer's own forward),
rolled back with the target's to the accepted length after every verify, its final blocks committed, and closed
when the request leaves. A proposer that keeps other state per request hears of the request's end through
``release``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...methods import Method, NgramSettings, SuffixSettings
from ..step_batch import StepBatch


@dataclass
class ProposerContext:
    """What a proposer may use: the engine's draft runner (None without a draft model), ids both models have,
    where tensors live, the lookup settings, a callback that records a draft forward's (rows, seconds) for the
    K policy, the suffix trees' settings and the EAGLE-3 heads."""

    draft_runner: object | None
    vocab_size: int
    device: torch.device
    ngram: NgramSettings
    record_draft: Callable[[int, float], None]
    medusa: tuple | None = None  # (MedusaHeads, TokenTree) when the engine serves method medusa
    target_runner: object | None = None  # the target's BatchModelRunner (lengths, hidden states of its forwards)
    suffix: SuffixSettings = SuffixSettings()
    eagle3: tuple | None = None  # (Eagle3Heads, tree mode) when the engine serves method eagle3 (their aux layers)


class Proposer(ABC):
    method: Method  # what the statistics record for the tokens it drafts
    uses_model: bool = False  # it runs draft forwards (the K policy adds their cost)
    wants_hidden: bool = False  # it drafts from the target's final hidden state: see verified()
    wants_states: bool = False  # it reads the target's aux-layer states of every token kept: see target_states()

    verify_width = None  # a tree proposer: callable K -> tokens its verify takes at K (None: K + 1, a chain)
    kv_runner = None  # the BatchModelRunner holding this proposer's own KV per request (None: it keeps none)

    def limit(self, batch: StepBatch, row: int, k: int) -> int:
        """The most tokens this proposer would draft for ``row`` with a budget of ``k`` (0: none this step)."""
        return k

    @abstractmethod
    def propose(self, batch: StepBatch, rows: list[int]) -> None:
        """Draft up to batch.k[row] tokens for each of ``rows`` and :meth:`StepBatch.put` them."""

    def verified(self, requests: list, hidden) -> None:
        """With ``wants_hidden``: after each verify, requests of this method that it advanced and the target's final
        hidden states [len(requests), d] at the last position each one accepted (a step may hand its rows over in
        several calls)."""

    def target_states(self, request, states) -> None:
        """With ``wants_states`` (and an engine made with ``aux_layers``): after each target forward that advanced
        ``request`` (a prompt chunk, or a verify), the outputs of the aux layers for the tokens it keeps
        [n, len(aux_layers), d], in sequence order, continuing where the last call ended: a chunk's tokens, or the
        verify's input before its drafts, the accepted drafts (a tree: its accepted path) and nothing of the rest.
        Over a request's life the calls cover every token of its sequence but the last one emitted, from the end of
        the prompt prefix it reused from the cache (the target computed nothing there; a proposer keeping KV in the
        target's blocks reuses its own KV of that prefix)."""

    def calibrate(self, record: Callable[[int, float], None], max_rows: int) -> None:
        """With ``uses_model`` and no draft model of the engine's: time a bare draft position for 1..max_rows rows
        and ``record(rows, seconds)`` each, so the K policy can price drafting before it has drafted."""

    def catch_up(self, requests: list) -> None:
        """With a ``kv_runner``: after a target forward that advanced these requests' prompts, bring their KV in
        kv_runner as far as the target's."""

    def release(self, request_id: int) -> None:
        """The request left the engine (finished, cancelled or failed): drop anything kept for it."""
