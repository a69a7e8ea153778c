"""Tokens a request's grammar forces, proposed as drafts (jump-forward decoding as a proposer).

Where the grammar leaves one way on (a JSON key the schema fixes, the punctuation between fields), the target's
masked distribution has all its mass on the forced token, so the draft is accepted without the target having had
to choose it: structured output gets faster instead of slower. The tokens come from the grammar library's own
fast-forward (its tokenization of the forced bytes); where the model would tokenize the same text another way, the
verify rejects the draft like any other, so output stays exactly the target's.

It drafts ahead of the request's own method, whatever that is, at any step whose grammar forces a token, within the
engine's K (the policy's per-row K does not apply: a forced token is as good as accepted); a request that asked for
K = 0 (target-only decoding) never gets one.
"""

from __future__ import annotations

import torch

from ...methods import GRAMMAR_PROPOSER
from ..step_batch import StepBatch
from .base import Proposer

class GrammarProposer(Proposer):
    method = GRAMMAR_PROPOSER  # type: ignore[assignment]  # not a speculative.method: it runs beside every method

    def __init__(self, vocab_size: int, device: torch.device, engine_draft_len: int):
        self.vocab_size = vocab_size
        self.device = device
        self.engine_draft_len = engine_draft_len

    def limit(self, batch: StepBatch, row: int, k: int) -> int:
        """Forced tokens for ``row`` (``k`` is ignored: see the module docstring), within the engine's K and the
        tokens the request may still emit."""
        request = batch.requests[row]
        if request.grammar is None or request.plan.max_draft_len == 0:
            return 0
        room = min(self.engine_draft_len, request.remaining - 1)
        return min(len(request.grammar.forced()), max(room, 0))

    def propose(self, batch: StepBatch, rows: list[int]) -> None:
        for row in rows:
            request = batch.requests[row]
            tokens = request.grammar.forced()[:batch.k[row]]
            probs = None
            if not request.params.greedy:  # drawn from a point mass: the accept rule keeps it wherever p > 0
                probs = torch.nn.functional.one_hot(torch.tensor(tokens), self.vocab_size).float().to(self.device)
            batch.put(row, tokens, probs, self.method)
