"""pipeline/parity.py: a greedy divergence fails only when the target's top-2 margin is clear."""

from __future__ import annotations

import pytest
import torch

from pipeline import parity

VOCAB = 16


# ---- scripts/gpu_smoke_parity.py: a divergence fails only when the target's top-2 margin is clear --------------------

def _logits(**values) -> torch.Tensor:
    row = torch.full((VOCAB,), -10.0)
    for token, value in values.items():
        row[int(token.removeprefix("t"))] = value
    return row


def test_divergence_near_tie_vs_clear():
    assert parity.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert parity.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert parity.first_divergence([1, 2], [1, 2, 3]) == 2
    seen = []

    def next_logits(ids):
        seen.append(ids)
        return _logits(t7=20.0, t9=19.8)  # the target's two best after the common prefix: 7, then 9 (gap 0.2)

    tie = parity.divergence([4, 4], [5, 7, 1], [5, 9, 1], next_logits)
    assert seen == [[4, 4, 5]]  # prompt + the common prefix of the two outputs
    assert (tie.position, tie.plain, tie.spec, tie.best, tie.second) == (1, 7, 9, 7, 9)
    assert tie.margin == pytest.approx(0.2, abs=1e-5) and tie.near_tie and "near-tie" in tie.describe()
    wide = parity.divergence([4], [7], [9], lambda ids: _logits(t7=21.0, t9=19.8))  # gap 1.2 > 0.5
    assert not wide.near_tie and "CLEAR" in wide.describe() and "margin 1.2000" in wide.describe()
    off_top2 = parity.divergence([4], [7], [3], lambda ids: _logits(t7=20.0, t9=19.9))  # 3 is far below the best
    assert not off_top2.near_tie
    # bf16 can store three logits exactly equal: any two of them may be emitted (seen on SmolLM2 in bfloat16).
    three = parity.divergence([4], [7], [3], lambda ids: _logits(t9=28.375, t3=28.375, t7=28.375, t5=27.875))
    assert three.near_tie and three.gap == 0.0 and "near-tie" in three.describe()
    ended = parity.divergence([4], [7], [7, 1], lambda ids: _logits(t7=20.0))  # one output ended: no tie to judge
    assert not ended.near_tie
    assert parity.divergence([4], [7, 8], [7, 8], lambda ids: 1 / 0) is None  # identical: no logits needed
