"""N-gram lookup as a proposer: the tokens that followed the sequence's latest recurring suffix (no model)."""

from __future__ import annotations

from ...methods import Method, NgramSettings
from ...speculative.ngram import one_hot_probs, propose_ngram
from ..step_batch import StepBatch
from .base import Proposer, ProposerContext


def row_lookup(batch: StepBatch, row: int, k: int, settings: NgramSettings) -> list[int]:
    """The row's match, up to ``k`` tokens. One lookup per row per step: the first call (at the row's own K, the
    largest asked for) is kept in the batch and later calls, the K policy's, the dispatch's and the proposer's, take
    its prefix."""
    found = batch.lookups.get(row)
    if found is None:
        found = propose_ngram(batch.requests[row].sequence, k, settings.min_match, settings.max_match)
        batch.lookups[row] = found
    return found[:k]


class NgramProposer(Proposer):
    method = Method.NGRAM

    def __init__(self, context: ProposerContext):
        self.settings = context.ngram
        self.vocab_size = context.vocab_size
        self.device = context.device

    def limit(self, batch: StepBatch, row: int, k: int) -> int:
        return len(row_lookup(batch, row, k, self.settings))

    def propose(self, batch: StepBatch, rows: list[int]) -> None:
        for row in rows:
            tokens = row_lookup(batch, row, batch.k[row], self.settings)
            # A lookup is a deterministic proposal: as a distribution it is one-hot, which keeps rejection sampling
            # lossless (the target keeps the token with probability target(token)).
            probs = None if batch.requests[row].params.greedy else one_hot_probs(tokens, self.vocab_size, self.device)
            batch.put(row, tokens, probs, self.method)
