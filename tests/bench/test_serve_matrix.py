"""pipeline/bench/serve_matrix.py: the modes' K, and the measurement matrix's interleaved rounds."""

from __future__ import annotations

from pipeline.bench import serve_matrix
from pipeline.bench.request_timing import RequestTiming
from pipeline.bench.serve_matrix import ServeOptions


def test_modes_name_the_right_draft_len():
    assert serve_matrix.mode_draft_len("target_only", 4) == 0
    assert serve_matrix.mode_draft_len("speculative_fixed", 4) == 4
    assert serve_matrix.mode_draft_len("speculative", 4) is None  # adaptive: the engine caps K
    assert serve_matrix.mode_draft_len("one_at_a_time", 4) is None


def test_further_fixed_k_and_method_modes():
    assert serve_matrix.mode_draft_len("speculative_k2", 4) == 2
    assert serve_matrix.is_mode("speculative_k7") and not serve_matrix.is_mode("speculative_kx")
    assert serve_matrix.is_mode("method_suffix") and not serve_matrix.is_mode("method_magic")
    assert serve_matrix.mode_method("method_ngram+draft") == "ngram+draft" and serve_matrix.mode_method("speculative") is None
    assert serve_matrix.mode_draft_len("method_suffix", 4) is None  # the policy chooses K


def test_matrix_interleaves_rounds_and_reports_each_cells_median(monkeypatch):
    calls = []
    speeds = iter([1.0, 3.0, 2.0, 1.0, 4.0, 2.0])  # round 1: cells A, B; round 2: A, B; round 3: A, B

    def fake_load(make, prompts, requests, concurrency, max_tokens, k, one_at_a_time, method=None):
        calls.append((concurrency, k, one_at_a_time))
        if len(calls) == 1:  # the warm-up
            return [RequestTiming(tokens=1, last_s=1.0)], 1.0
        return [RequestTiming(tokens=10, first_s=0.1, last_s=1.0, itl_s=[0.1])], 10.0 / next(speeds)

    monkeypatch.setattr(serve_matrix, "run_load", fake_load)
    options = ServeOptions(concurrency=[2], requests=4, rounds=3, modes=["target_only", "speculative_fixed"],
                           paths=["engine"])
    records = serve_matrix.run_matrix({"engine": object}, [[1]], options, k=3, note=lambda _: None)
    assert calls[1:] == [(2, 0, False), (2, 3, False)] * 3  # interleaved: A B A B A B, never A A A B B B
    assert [r["tokens_per_s"] for r in records] == [2.0, 2.0]  # A: 1, 2, 4; B: 3, 1, 2
    assert [(r["tokens_per_s_min"], r["tokens_per_s_max"]) for r in records] == [(1.0, 4.0), (1.0, 3.0)]
    assert records[0]["rounds"] == [1.0, 2.0, 4.0] and not records[0]["within_spread_goal"]
    assert [r["k"] for r in records] == [0, 3]


def test_exact_match_against_target_only_on_the_same_path_and_concurrency(monkeypatch):
    outputs = {0: [[5, 6], [7, 8]], 3: [[5, 6], [7, 9]]}  # K=3 got the second prompt's answer wrong

    def fake_load(make, prompts, requests, concurrency, max_tokens, k, one_at_a_time, method=None):
        timings = [RequestTiming(tokens=2, first_s=0.1, last_s=1.0, itl_s=[0.1]) for _ in range(2)]
        for timing, output in zip(timings, outputs.get(k, outputs[0])):
            timing.output = output
        return timings, 1.0

    monkeypatch.setattr(serve_matrix, "run_load", fake_load)
    options = ServeOptions(concurrency=[2], requests=2, rounds=1, modes=["target_only", "speculative_fixed"],
                           paths=["engine"])
    records = serve_matrix.run_matrix({"engine": object}, [[1], [2]], options, k=3, note=lambda _: None)
    assert [r["exact_match"] for r in records] == [1.0, 0.5]
    assert all("outputs" not in r for r in records)


def test_cell_usage_from_totals_before_and_after():
    before = {"queried_tokens": 100, "hit_tokens": 40, "steps": 10, "rows": 20}
    after = {"queried_tokens": 300, "hit_tokens": 190, "steps": 30, "rows": 80}
    none = {"prefix_hit_rate": None, "occupancy": None, "engine_steps": None, "total_positions": None}
    assert serve_matrix.cell_usage(before, after, max_batch=4) == {**none, "prefix_hit_rate": 0.75, "occupancy": 0.75,
                                                                   "engine_steps": 20}
    missing = {**after, "hit_tokens": None, "rows": None}  # a server without these counters
    assert serve_matrix.cell_usage(before, missing, 4) == {**none, "engine_steps": 20}
    assert serve_matrix.cell_usage(None, None, 4) == none
    assert serve_matrix.cell_usage(before, before, 4) == {**none, "engine_steps": 0}  # idle


def test_cell_usage_per_position_from_the_cells_share_of_the_counters():
    """Triton's position counters are totals since the server started: the cell's rates come from their growth."""
    before = {"drafted_at": [10, 10], "accepted_at": [10, 0]}
    after = {"drafted_at": [20, 20, 4], "accepted_at": [15, 5, 1]}
    assert serve_matrix.cell_usage(before, after, 4)["total_positions"] == [0.5, 0.5, 0.25]


def test_matrix_reads_each_paths_totals_around_each_cell(monkeypatch):
    monkeypatch.setattr(serve_matrix, "run_load", lambda *args: ([RequestTiming(tokens=4, last_s=1.0)], 1.0))
    reads = iter([{"queried_tokens": 0, "hit_tokens": 0, "steps": 0, "rows": 0},
                  {"queried_tokens": 10, "hit_tokens": 5, "steps": 4, "rows": 6}])
    options = ServeOptions(concurrency=[1], requests=1, rounds=1, modes=["speculative"], paths=["engine", "triton"])
    records = serve_matrix.run_matrix({"engine": object, "triton": object}, [[1]], options, k=3,
                                      note=lambda _: None, totals={"engine": lambda: next(reads)}, max_batch=2)
    assert (records[0]["prefix_hit_rate"], records[0]["occupancy"]) == (0.5, 0.75)
    assert (records[1]["prefix_hit_rate"], records[1]["occupancy"]) == (None, None)  # no reader for triton
