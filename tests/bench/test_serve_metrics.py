"""pipeline/bench/serve_metrics.py: acceptance length per request, per-position acceptance, exact match, spread."""

from __future__ import annotations

import pytest

from pipeline.bench.request_timing import RequestTiming, TokenArrivals, summarize
from pipeline.bench.serve_metrics import (acceptance_summary, exact_match, median_round, position_rates,
                                          request_positions, spread, step_histogram)


def _timing(accepted: int, steps: int, drafted_at=None, accepted_at=None) -> RequestTiming:
    timing = RequestTiming(tokens=accepted + steps, last_s=1.0)
    timing.take_stats(4 * steps, accepted, steps, drafted_at, accepted_at)
    return timing


def test_acceptance_length_is_one_plus_accepted_per_step_per_request():
    timings = [_timing(0, 10), _timing(10, 10), _timing(25, 10), RequestTiming()]  # the last ran no step
    summary = acceptance_summary(timings)
    assert summary["acceptance_length_per_request"] == [1.0, 2.0, 3.5]
    assert summary["acceptance_length"] == pytest.approx(6.5 / 3, abs=1e-4)
    histogram = summary["acceptance_length_histogram"]
    assert histogram["edges"][0] == 1.0 and histogram["edges"][-1] == 3.75
    assert histogram["counts"] == [1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1]
    assert acceptance_summary([RequestTiming()])["acceptance_length"] is None


def test_per_position_acceptance_among_the_steps_that_drafted_there():
    # position 1 drafted in 10 steps and kept in 6; position 2 drafted in 8, kept in 2; position 3 never drafted
    assert position_rates([10, 8, 0], [6, 2, 0]) == [0.6, 0.25]
    assert position_rates([0, 0], [0, 0]) is None
    timings = [_timing(3, 2, [2, 2], [2, 1]), _timing(1, 2, [2, 1, 1], [1, 0, 0]), _timing(0, 1)]
    assert request_positions(timings) == [0.75, 0.3333, 0.0]
    assert request_positions([_timing(0, 1)]) is None  # no request carried its position counts


def test_exact_match_by_request_index():
    assert exact_match([[1, 2], [3]], [[1, 2], [4]]) == 0.5
    assert exact_match(["ab", "c"], ["ab", "c"]) == 1.0
    assert exact_match([[1]], [None]) is None and exact_match([[1]], [[1], [2]]) is None


def test_spread_and_the_median_round():
    assert spread([100.0, 104.0, 97.0]) == {"tokens_per_s_min": 97.0, "tokens_per_s_median": 100.0,
                                            "tokens_per_s_max": 104.0, "rounds": [100.0, 104.0, 97.0],
                                            "within_spread_goal": True}
    assert not spread([100.0, 106.0, 99.0])["within_spread_goal"]
    rounds = [{"tokens_per_s": 3.0, "id": "a"}, {"tokens_per_s": 1.0, "id": "b"}, {"tokens_per_s": 2.0, "id": "c"}]
    assert median_round(rounds)["id"] == "c"


def test_tpot_is_the_time_per_token_after_the_first():
    clock = TokenArrivals()
    clock.start = 0.0
    clock.arrived(1, 0.5, ids=[7])
    clock.arrived(3, 0.8, ids=[8, 9, 10])
    clock.arrived(1, 1.1, ids=[11])
    clock.timing.last_s = 1.1
    assert clock.timing.tpot_s == pytest.approx(0.6 / 4)
    assert clock.timing.output == [7, 8, 9, 10, 11]
    record = summarize([clock.timing], 2.0)
    assert record["tpot_ms_p50"] == pytest.approx(150.0) and record["ttft_ms_p50"] == pytest.approx(500.0)
    assert RequestTiming(tokens=5, last_s=1.0).tpot_s is None  # no first-token time on this path


def test_the_steps_histogram_from_step_by_step_reports():
    """A stream reports the running totals after every step: each report one step on adds that step's tokens. A
    report that covers several steps at once (an HTTP answer) leaves the request out."""
    streamed = RequestTiming()
    for drafted, accepted, steps in ((0, 0, 1), (4, 3, 2), (8, 3, 3), (8, 3, 3), (12, 5, 4)):  # a repeat: no step
        streamed.take_stats(drafted, accepted, steps)
    assert streamed.step_tokens == [1, 4, 1, 3]
    answered = RequestTiming()
    answered.take_stats(12, 5, 4)
    assert answered.step_tokens is None
    assert step_histogram([streamed, answered]) == {"1": 2, "3": 1, "4": 1}
    assert step_histogram([answered]) is None
