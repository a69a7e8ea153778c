"""``ngram+draft``: per step and per request, the n-gram lookup or the draft model, whichever promises more.

The comparison is expected emitted tokens per unit of cost: a lookup costs no model forward (only the verify), the
draft model costs K draft forwards of c verify-forwards each. Each proposer's acceptance is the request's own
(an AcceptanceEstimate per proposer, see pipeline.executor.acceptance), so a request whose output copies its
prompt drifts to lookups and one that does not drifts to the draft model. Both executors choose through
proposers/dispatch.py, which prices the two with :func:`prefer_lookup`. A seeded sampling request prices the draft
at UNMEASURED_COST_RATIO, not at the measured c: which proposer drafts changes its random draws, and its tokens must
not depend on how fast the machine or the batch it shares ran.
"""

from __future__ import annotations

from ...methods import Method
from ...speculative.analytic import expected_tokens_per_step
from ..request import SpecRequest
from ..step_batch import StepBatch
from .base import Proposer


UNMEASURED_COST_RATIO = 0.25  # c before both phases ran, and for seeded sampling requests


class CostRatio:
    """c: one draft position over one verify, as measured (running means). Both executors keep one; the
    ngram+draft choice prices the draft model with it."""

    def __init__(self):
        self._seconds = {"draft": 0.0, "target": 0.0}

    def record(self, role: str, seconds: float) -> None:
        mean = self._seconds[role]
        self._seconds[role] = seconds if mean == 0 else 0.9 * mean + 0.1 * seconds

    @property
    def value(self) -> float:
        draft, target = self._seconds["draft"], self._seconds["target"]
        return draft / target if draft > 0 and target > 0 else UNMEASURED_COST_RATIO


def prefer_lookup(request: SpecRequest, lookup_len: int, k: int, cost_ratio: float) -> bool:
    """Whether a found lookup of ``lookup_len`` tokens beats drafting ``k`` with the model (c = ``cost_ratio``)."""
    if request.seeded and not request.params.greedy:
        cost_ratio = UNMEASURED_COST_RATIO
    lookup_rate = request.acceptance(Method.NGRAM).rate
    draft_rate = request.acceptance(Method.DRAFT_MODEL).rate
    gain_lookup = expected_tokens_per_step(lookup_rate, lookup_len)
    gain_draft = expected_tokens_per_step(draft_rate, k) / (1 + k * cost_ratio)
    return gain_lookup >= gain_draft


class NgramOrDraftProposer(Proposer):
    """What the K policy knows of an ngram+draft row before the choice; the drafting itself is the chosen one's."""

    method = Method.NGRAM_DRAFT
    uses_model = True  # the draft's cost bounds what the row's step can cost

    def __init__(self, draft: Proposer):
        self.draft = draft  # the draft model's proposer: its KV is the row's whichever drafts a step
        self.kv_runner = draft.kv_runner

    def catch_up(self, requests: list) -> None:
        self.draft.catch_up(requests)

    def propose(self, batch: StepBatch, rows: list[int]) -> None:
        raise AssertionError("ngram+draft hands every row to the lookup or the draft model (dispatch.choose_drafter)")
