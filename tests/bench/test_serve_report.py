"""pipeline/bench/serve_report.py: speedups and targets compare the same path and concurrency."""

from __future__ import annotations

from pipeline.bench.serve_matrix import add_ratios
from pipeline.bench.serve_report import targets_met


def _record(mode, c, tps, p99=100.0):
    return {"path": "triton", "mode": mode, "concurrency": c, "tokens_per_s": tps, "latency_ms_p99": p99,
            "ttft_ms_p99": None, "itl_ms_p99": 1.0}


def test_ratios_and_targets_use_the_same_path_and_concurrency():
    records = [_record("one_at_a_time", 1, 100), _record("target_only", 1, 100), _record("speculative", 1, 140),
               _record("one_at_a_time", 32, 100, p99=900), _record("target_only", 32, 600),
               _record("speculative", 32, 560, p99=300)]
    add_ratios(records)
    assert records[2]["speedup_vs_target_only"] == 1.4 and records[5]["speedup_vs_one_at_a_time"] == 5.6
    lines = targets_met(records)
    assert "5.60x one-at-a-time tokens/s (target >= 5x: met)" in lines[0] and "(lower)" in lines[0]
    # 560 / 600 = 0.93 < 0.95 at C=32, while C=1 is 1.40 >= 1.3.
    assert ">= 1.3x at C<=4: met; >= 0.95x everywhere: NOT met" in lines[1]
    fixed = [_record("speculative_fixed", 1, 112), _record("speculative_fixed", 32, 700)]
    assert targets_met(records + fixed)[2] == "triton: adaptive K / fixed K tokens/s C=1 1.25x, C=32 0.80x"
