"""pipeline/bench/timing.py: percentiles and the measured cost terms (c, the verify cost per K)."""

from __future__ import annotations

import pytest

from pipeline.bench.timing import CostTerms, percentile


def test_percentile_and_cost_terms():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([5.0], 90) == 5.0
    costs = CostTerms(target_ms=4.0, draft_ms=1.0, verify_ms=[5.0, 6.0], context_tokens=10, repeats=3)
    assert costs.cost_ratio_c == pytest.approx(0.25)
    assert costs.verify_cost_ratio == pytest.approx([1.25, 1.5])
    assert costs.verify_cost(0) == 1.0
    with pytest.raises(ValueError, match="k: 3 was not measured"):
        costs.verify_cost(3)
