"""pipeline/bench/records.py: a record's decode rate leaves each prompt's first token (its prefill) out."""

from __future__ import annotations

import pytest

from pipeline.bench.measure import Sample
from pipeline.bench.records import make_record
from pipeline.bench.timing import CostTerms


def test_decode_rate_leaves_out_each_prompts_time_to_its_first_token():
    costs = CostTerms(target_ms=4.0, draft_ms=1.0, verify_ms=[5.0], context_tokens=10, repeats=2)
    # two prompts: 11 tokens in 1.2 s after a 0.2 s prefill, 6 tokens in 0.8 s after 0.3 s
    first = [Sample(tokens=11, seconds=1.2, ttft_s=0.2, steps=[(0, 0)] * 11),
             Sample(tokens=6, seconds=0.8, ttft_s=0.3, steps=[(0, 0)] * 6)]
    slower = [Sample(tokens=11, seconds=2.2, ttft_s=0.2), Sample(tokens=6, seconds=1.8, ttft_s=0.3)]
    fastest = [Sample(tokens=11, seconds=1.0, ttft_s=0.1), Sample(tokens=6, seconds=0.5, ttft_s=0.1)]
    record = make_record("target", 0, "code", [first, slower, fastest], costs)
    assert record["tokens_per_s"] == pytest.approx(17 / 2.0)  # the median repeat, prefill included
    assert record["decode_tokens_per_s"] == pytest.approx(15 / 1.5)  # (10 + 5) tokens in (1.0 + 0.5) s
