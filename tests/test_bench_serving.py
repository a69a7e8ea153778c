"""The serving benchmark (`python -m pipeline bench-serve`): its load generator, summaries and the command end to end.

Fast: the engine path on the session's tiny pair at concurrency 1 and 2 with a few tokens; the Triton paths run
briefly under the `server` marker.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from pipeline.bench import serve_matrix
from pipeline.bench.load_generator import run_load
from pipeline.bench.request_timing import RequestTiming, summarize
from pipeline.bench.serve_matrix import ServeOptions, add_ratios
from pipeline.bench.serve_report import targets_met
from conftest import run_cli, tiny_config_dict, write_config


class _SleepClient:
    """Emits ``max_tokens`` tokens in one group after ``delay_s``; counts how many requests overlap."""

    active = 0
    peak = 0
    guard = threading.Lock()

    def __init__(self, delay_s: float = 0.02):
        self.delay_s = delay_s

    def send(self, prompt_ids, max_tokens, k):
        with self.guard:
            type(self).active += 1
            type(self).peak = max(type(self).peak, type(self).active)
        timing = RequestTiming()
        time.sleep(self.delay_s)
        with self.guard:
            type(self).active -= 1
        timing.first_s = timing.last_s = time.perf_counter() - timing.started
        timing.tokens = max_tokens
        return timing

    def close(self):
        pass


def _fresh_sleep_client():
    _SleepClient.active = _SleepClient.peak = 0
    return _SleepClient


def test_one_at_a_time_never_overlaps_and_counts_the_lock_wait():
    cls = _fresh_sleep_client()
    timings, wall = run_load(cls, [[1, 2]], requests=8, concurrency=4, max_tokens=3, k=None, one_at_a_time=True)
    assert cls.peak == 1
    assert sum(t.tokens for t in timings) == 24
    # 8 serialized sleeps of 20 ms: the last-served request waited for the others, and its latency shows it.
    assert wall >= 8 * 0.02
    assert max(t.last_s for t in timings) >= 3 * 0.02


def test_batched_load_overlaps_up_to_the_concurrency_and_sends_every_request():
    cls = _fresh_sleep_client()
    timings, _ = run_load(cls, [[1], [2]], requests=10, concurrency=4, max_tokens=2, k=0, one_at_a_time=False)
    assert cls.peak == 4
    assert len(timings) == 10 and all(t is not None for t in timings)


def test_a_failed_request_fails_the_load():
    class Failing(_SleepClient):
        def send(self, prompt_ids, max_tokens, k):
            timing = super().send(prompt_ids, max_tokens, k)
            timing.error = "boom"
            return timing

    with pytest.raises(RuntimeError, match="boom"):
        run_load(Failing, [[1]], requests=2, concurrency=2, max_tokens=2, k=None, one_at_a_time=False)


def test_summary_rates_and_percentiles():
    timings = [RequestTiming(tokens=4, first_s=0.010, last_s=0.040, itl_s=[0.01] * 3, drafted=6, accepted=3, steps=2),
               RequestTiming(tokens=4, first_s=0.030, last_s=0.060, itl_s=[0.01] * 3, drafted=0, accepted=0, steps=2)]
    s = summarize(timings, wall_s=0.5)
    assert s["tokens_per_s"] == 16.0 and s["requests_per_s"] == 4.0
    assert s["ttft_ms_p50"] == pytest.approx(20.0) and s["itl_ms_p99"] == pytest.approx(10.0)
    assert s["mean_draft_len"] == 1.5 and s["acceptance_rate"] == 0.5
    no_ttft = summarize([RequestTiming(tokens=2, first_s=None, last_s=0.1, itl_s=[0.05, 0.05])], 0.1)
    assert no_ttft["ttft_ms_p50"] is None  # a path that cannot see the first token reports none, not zero


def test_modes_name_the_right_draft_len():
    assert serve_matrix.mode_draft_len("target_only", 4) == 0
    assert serve_matrix.mode_draft_len("speculative_fixed", 4) == 4
    assert serve_matrix.mode_draft_len("speculative", 4) is None  # adaptive: the engine caps K
    assert serve_matrix.mode_draft_len("one_at_a_time", 4) is None


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


def test_matrix_interleaves_rounds_and_keeps_each_cells_best(monkeypatch):
    calls = []
    speeds = iter([1.0, 3.0, 2.0, 1.0])  # round 1: cells A, B; round 2: A, B

    def fake_load(make, prompts, requests, concurrency, max_tokens, k, one_at_a_time):
        calls.append((concurrency, k, one_at_a_time))
        if len(calls) == 1:  # the warm-up
            return [RequestTiming(tokens=1, last_s=1.0)], 1.0
        return [RequestTiming(tokens=10, first_s=0.1, last_s=1.0, itl_s=[0.1])], 10.0 / next(speeds)

    monkeypatch.setattr(serve_matrix, "run_load", fake_load)
    options = ServeOptions(concurrency=[2], requests=4, rounds=2, modes=["target_only", "speculative_fixed"],
                           paths=["engine"])
    records = serve_matrix.run_matrix({"engine": object}, [[1]], options, k=3, note=lambda _: None)
    assert calls[1:] == [(2, 0, False), (2, 3, False)] * 2  # interleaved: A B A B, never A A B B
    assert [r["tokens_per_s"] for r in records] == [2.0, 3.0]
    assert [r["k"] for r in records] == [0, 3]


@pytest.fixture(scope="module")
def engine_bench(built_engines, tmp_path_factory):
    config_path, engines = built_engines
    out = tmp_path_factory.mktemp("serving")
    result = run_cli("bench-serve", str(config_path), "--engines-dir", str(engines), "--paths", "engine",
                     "--concurrency", "1,2", "--requests", "4", "--max-tokens", "6", "--rounds", "2",
                     "--hf-rounds", "1", "--num-prompts", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads((out / "serving.json").read_text()), out, result.stdout


def test_engine_path_end_to_end(engine_bench):
    data, out, stdout = engine_bench
    cells = {(r["mode"], r["concurrency"]): r for r in data["records"]}
    assert set(cells) == {(m, c) for m in serve_matrix.MODES for c in (1, 2)}
    for (mode, _), r in cells.items():
        assert r["path"] == "engine" and r["requests"] == 4 and r["tokens"] <= 4 * 6
        assert r["tokens_per_s"] > 0 and r["ttft_ms_p50"] > 0 and r["itl_ms_p99"] >= r["itl_ms_p50"] > 0
        if mode == "target_only":  # max_draft_len=0 reaches the engine: nothing drafted
            assert r["mean_draft_len"] == 0
        else:
            assert r["mean_draft_len"] > 0
    assert cells[("speculative_fixed", 1)]["k"] == data["options"]["k"]
    assert data["batch1_target_vs_hf"]["target_tokens_per_s"] > 0 and data["batch1_target_vs_hf"]["hf_target_tokens_per_s"] > 0
    assert data["machine"]["cpu"] and data["machine"]["torch"]
    assert (out / "serving.png").stat().st_size > 10_000
    assert "speculative_fixed" in stdout and "wrote" in stdout


def test_an_ngram_config_is_benchmarked_with_lookups(tiny_pair, tmp_path):
    """The config's speculative.method reaches the benchmarked engine: an n-gram config has no draft engine."""
    from pipeline.config import load_config
    from pipeline.stages import run_stages

    data = tiny_config_dict(tiny_pair, name="tiny-ngram")
    data.pop("draft")
    config_path = write_config(tmp_path, {**data, "speculative": {**data["speculative"], "method": "ngram"}})
    run_stages(load_config(config_path), tmp_path / "engines", ("convert", "build"))
    result = run_cli("bench-serve", str(config_path), "--engines-dir", str(tmp_path / "engines"), "--paths", "engine",
                     "--modes", "speculative_fixed", "--concurrency", "1", "--requests", "2", "--max-tokens", "6",
                     "--rounds", "1", "--hf-rounds", "0", "--num-prompts", "2", "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-2000:]
    (record,) = json.loads((tmp_path / "out" / "serving.json").read_text())["records"]
    assert record["mode"] == "speculative_fixed" and record["tokens"] > 0


def test_bad_flags_name_the_flag(built_engines):
    config_path, engines = built_engines
    result = run_cli("bench-serve", str(config_path), "--engines-dir", str(engines), "--modes", "speculative,fast")
    assert result.returncode != 0 and "--modes: fast unknown" in result.stderr
    result = run_cli("bench-serve", str(config_path), "--engines-dir", str(engines), "--concurrency", "8",
                     "--requests", "4")
    assert result.returncode != 0 and "--concurrency: 8" in result.stderr


@pytest.mark.server
def test_triton_paths_briefly(built_engines, tmp_path):
    pytest.importorskip("tritonclient.http")
    pytest.importorskip("tritonclient.grpc")
    config_path, engines = built_engines
    result = run_cli("bench-serve", str(config_path), "--engines-dir", str(engines), "--paths", "triton,triton_stream",
                     "--modes", "one_at_a_time,target_only", "--concurrency", "2", "--requests", "2",
                     "--max-tokens", "4", "--rounds", "1", "--hf-rounds", "0", "--out", str(tmp_path), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads((tmp_path / "serving.json").read_text())["records"]
    by_path = {(r["path"], r["mode"]): r for r in records}
    assert set(by_path) == {(p, m) for p in ("triton", "triton_stream") for m in ("one_at_a_time", "target_only")}
    assert by_path[("triton", "target_only")]["ttft_ms_p50"] is None  # HTTP request/response: no first token
    assert by_path[("triton_stream", "target_only")]["ttft_ms_p50"] > 0
    for r in records:
        assert 0 < r["tokens"] <= 2 * 4 and r["tokens_per_s"] > 0
    assert by_path[("triton", "target_only")]["mean_draft_len"] == 0  # num_draft_tokens=0 reached the engine
