"""Who proposes a request's draft tokens this step: the draft model, n-gram lookup, or the better of the two.

``ngram+draft`` chooses per step and per request by expected tokens per unit of cost: the n-gram proposer costs no
model forward (only the verify), the draft model costs K draft forwards, c target-forwards each. Each proposer's
acceptance is this request's own so far (shrunk towards a prior while its history is short), so a request whose
output copies its prompt drifts to lookup and one that does not drifts to the draft model.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..speculative.analytic import expected_tokens_per_step
from ..speculative.ngram import propose_ngram
from .request import SpecRequest

METHODS = ("draft_model", "ngram", "ngram+draft")
DRAFT, NGRAM = "draft_model", "ngram"
PRIOR_RATE = {DRAFT: 0.6, NGRAM: 0.4}  # before a request has history; a few steps of its own outweigh these


@dataclass(frozen=True)
class NgramSettings:
    min_match: int = 1  # shortest suffix that may be looked up
    max_match: int = 4  # longest suffix tried first


def check_method(method: str, has_draft_model: bool) -> None:
    if method not in METHODS:
        raise ValueError(f"method: {method!r} is unknown; use one of {', '.join(METHODS)}")
    if method != NGRAM and not has_draft_model:
        raise ValueError(f"method: {method!r} needs a draft model; pass one, or use method 'ngram'")


def choose_proposal(request: SpecRequest, k: int, ngram: NgramSettings, cost_ratio: float
                    ) -> tuple[str | None, list[int]]:
    """(proposer, tokens): ("ngram", its tokens), (DRAFT, []) for the draft model to run, or (None, []) to
    decode plainly this step."""
    if k <= 0:
        return None, []
    if request.method == DRAFT:
        return DRAFT, []
    lookup = propose_ngram(request.sequence, k, ngram.min_match, ngram.max_match)
    if request.method == NGRAM:
        return (NGRAM, lookup) if lookup else (None, [])
    if not lookup:
        return DRAFT, []
    # Expected emitted tokens per target-forward of cost: lookup costs only the verify.
    gain_lookup = expected_tokens_per_step(request.proposer_rate(NGRAM, PRIOR_RATE[NGRAM]), len(lookup))
    gain_draft = expected_tokens_per_step(request.proposer_rate(DRAFT, PRIOR_RATE[DRAFT]), k) / (1 + k * cost_ratio)
    return (NGRAM, lookup) if gain_lookup >= gain_draft else (DRAFT, [])
