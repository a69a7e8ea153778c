"""Which proposer drafts a request's next step: one rule, followed by both executors.

The torch engine asks it for each decoding row of a batch, the TensorRT-LLM executor for its request at every step;
each then runs the chosen proposer, or a plain target step where the answer is None. A method's own proposer drafts,
except for the methods that choose: ``ngram`` drafts only where the lookup found a match, and ``ngram+draft`` takes
the lookup or the draft model, whichever promises more tokens per unit of cost (:func:`prefer_lookup`).
"""

from __future__ import annotations

from collections.abc import Callable

from ...methods import Method
from ..request import SpecRequest
from .ngram_or_draft import prefer_lookup


def choose_drafter(request: SpecRequest, step_draft_len: int, lookup: Callable[[int], list[int]],
                   cost_ratio: float) -> Method | None:
    """The method whose proposer drafts ``request``'s next step of up to ``step_draft_len`` (> 0) tokens, or None
    for a plain step. ``lookup(k)``: the n-gram match of up to k tokens, called only for the methods that look up;
    ``cost_ratio``: c, one draft-model position's cost over one verify's."""
    method = request.method
    if method not in (Method.NGRAM, Method.NGRAM_DRAFT):
        return method
    found = lookup(step_draft_len)
    if method == Method.NGRAM:
        return Method.NGRAM if found else None
    if found and prefer_lookup(request, len(found), step_draft_len, cost_ratio):
        return Method.NGRAM
    return Method.DRAFT_MODEL
