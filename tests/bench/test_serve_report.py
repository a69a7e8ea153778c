"""pipeline/bench/serve_report.py: speedups and targets compare the same path and concurrency."""

from __future__ import annotations

from pipeline.bench.serve_matrix import add_ratios
from pipeline.bench.serve_report import targets_met


def _record(mode, c, tps, p99=100.0, path="triton"):
    return {"path": path, "mode": mode, "concurrency": c, "tokens_per_s": tps, "latency_ms_p99": p99,
            "ttft_ms_p99": None, "itl_ms_p99": 1.0}


def test_ratios_and_targets_use_the_same_path_and_concurrency():
    records = [_record("one_at_a_time", 1, 100), _record("target_only", 1, 100), _record("speculative", 1, 140),
               _record("one_at_a_time", 32, 100, p99=900), _record("target_only", 32, 600),
               _record("speculative", 32, 560, p99=300)]
    add_ratios(records)
    assert records[2]["speedup_vs_target_only"] == 1.4 and records[5]["speedup_vs_one_at_a_time"] == 5.6
    lines = targets_met(records)
    assert "5.60x one-at-a-time tokens/s" in lines[0] and "(lower)" in lines[0]
    # 560 / 600 = 0.93 < 0.95 at C=32, while C=1 is 1.40.
    assert lines[1] == ("triton: policy / max(target-only, best fixed K) tokens/s C=1 1.40x, C=32 0.93x; >= 0.95x at "
                        "every C: not reached")
    fixed = [_record("speculative_fixed", 1, 112), _record("speculative_k2", 1, 150), _record("speculative_k2", 32, 700)]
    lines = targets_met(records + fixed)
    # the best fixed K at C=1 is K=2 (150), at C=32 also K=2 (700)
    assert lines[1] == ("triton: policy / max(target-only, best fixed K) tokens/s C=1 0.93x, C=32 0.80x; >= 0.95x at "
                        "every C: not reached")
    assert lines[2] == "triton: policy / best fixed K at C=1 0.93x (target >= 0.9x: reached)"


def test_repeats_within_five_percent_of_their_median():
    records = [{**_record("target_only", 1, 100), "rounds": [96, 100, 104], "within_spread_goal": True,
                "tokens_per_s_min": 96, "tokens_per_s_median": 100, "tokens_per_s_max": 104},
               {**_record("speculative", 1, 100), "rounds": [80, 100, 101], "within_spread_goal": False,
                "tokens_per_s_min": 80, "tokens_per_s_median": 100, "tokens_per_s_max": 101}]
    assert targets_met(records)[-1] == ("repeats within +-5% of their median: 1/2 cells (widest: triton speculative "
                                        "C=1 80.0-101.0 tok/s): not reached")


def test_the_triton_goal_at_32_clients_and_speculative_at_least_target_only():
    records = [_record(mode, c, tps, path=path) for path, mode, c, tps in [
        ("engine", "one_at_a_time", 32, 100), ("engine", "speculative", 32, 900),
        ("triton", "target_only", 4, 300), ("triton", "speculative", 4, 330),
        ("triton", "one_at_a_time", 32, 100), ("triton", "target_only", 32, 400), ("triton", "speculative", 32, 450),
        ("triton_stream", "one_at_a_time", 32, 100), ("triton_stream", "speculative", 32, 520)]]
    lines = targets_met(records)
    assert "triton: policy / target-only tokens/s C=4 1.10x, C=32 1.12x" in lines[3]
    assert lines[3].endswith("never slower (>= 1x at every C): reached")
    # the engine's 9x does not count: the goal is through Triton; triton_stream's 5.2x does
    assert lines[-1] == ("through Triton at C=32: speculative / one-at-a-time tokens/s triton 4.50x, "
                         "triton_stream 5.20x (target >= 5x: reached)")
    assert targets_met(records[:4])[-1].startswith("through Triton at C=32: speculative >= 5x one-at-a-time tokens/s "
                                                   "not measured")
