"""pipeline/speculative/ngram.py: n-gram (prompt-lookup) proposals, exact lookups."""

from __future__ import annotations

import pytest

from pipeline.speculative.ngram import one_hot_probs, propose_ngram


@pytest.mark.parametrize("tokens, k, kw, expected", [
    ([1, 2, 3, 4, 9, 1, 2, 3], 3, {}, [4, 9, 1]),  # longest suffix [1,2,3] recurs
    ([1, 2, 3, 4, 9, 2, 3], 3, {"max_match": 2}, [4, 9, 2]),
    ([5, 6, 7], 2, {}, []),  # nothing recurs
    ([1, 2, 1, 3, 1], 2, {"min_match": 2}, []),  # only a 1-token match, below min_match
    ([1, 2, 1, 3, 1], 2, {}, [3, 1]),  # most recent 1-token match wins
    ([7, 8, 1, 9, 9, 7, 8, 1, 5, 7, 8], 4, {}, [1, 5, 7, 8]),  # most recent of two equal-length matches
    ([7, 8, 1, 9, 9, 7, 8, 1, 5, 8], 4, {}, [1, 9, 9, 7]),  # equal matches: a full-length proposal beats a recent
    # one that runs into the end of the sequence
    ([5, 1, 2, 9, 1, 2], 3, {}, [9, 1, 2]),  # the only match's proposal may itself reach the end
    ([3, 3, 3], 0, {}, []),
])
def test_lookup(tokens, k, kw, expected):
    assert propose_ngram(tokens, k, **kw) == expected


def test_one_hot_probs():
    probs = one_hot_probs([2, 0], 4)
    assert probs.tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]
