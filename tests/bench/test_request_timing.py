"""pipeline/bench/request_timing.py: per-request timings summarized as rates and percentiles."""

from __future__ import annotations

import pytest

from pipeline.bench.request_timing import RequestTiming, summarize


def test_summary_rates_and_percentiles():
    timings = [RequestTiming(tokens=4, first_s=0.010, last_s=0.040, itl_s=[0.01] * 3, drafted=6, accepted=3, steps=2),
               RequestTiming(tokens=4, first_s=0.030, last_s=0.060, itl_s=[0.01] * 3, drafted=0, accepted=0, steps=2)]
    s = summarize(timings, wall_s=0.5)
    assert s["tokens_per_s"] == 16.0 and s["requests_per_s"] == 4.0
    assert s["ttft_ms_p50"] == pytest.approx(20.0) and s["itl_ms_p99"] == pytest.approx(10.0)
    assert s["mean_draft_len"] == 1.5 and s["acceptance_rate"] == 0.5
    no_ttft = summarize([RequestTiming(tokens=2, first_s=None, last_s=0.1, itl_s=[0.05, 0.05])], 0.1)
    assert no_ttft["ttft_ms_p50"] is None  # a path that cannot see the first token reports none, not zero
