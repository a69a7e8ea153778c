"""pipeline/bench/load_generator.py: one-at-a-time and concurrent load, every request sent, a failed request fails the
load."""

from __future__ import annotations

import threading
import time

import pytest

from pipeline.bench.load_generator import run_load
from pipeline.bench.request_timing import RequestTiming


class _SleepClient:
    """Emits ``max_tokens`` tokens in one group after ``delay_s``; counts how many requests overlap."""

    active = 0
    peak = 0
    guard = threading.Lock()

    def __init__(self, delay_s: float = 0.02):
        self.delay_s = delay_s

    sent: list = []  # (k, method) of every request

    def send(self, prompt_ids, max_tokens, k, method=None):
        self.sent.append((k, method))
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
    _SleepClient.sent = []
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
    assert set(cls.sent) == {(0, None)}


def test_every_request_names_the_method_it_is_given():
    cls = _fresh_sleep_client()
    run_load(cls, [[1]], requests=3, concurrency=3, max_tokens=2, k=None, one_at_a_time=False, method="suffix")
    assert cls.sent == [(None, "suffix")] * 3


def test_a_failed_request_fails_the_load():
    class Failing(_SleepClient):
        def send(self, prompt_ids, max_tokens, k, method=None):
            timing = super().send(prompt_ids, max_tokens, k, method)
            timing.error = "boom"
            return timing

    with pytest.raises(RuntimeError, match="boom"):
        run_load(Failing, [[1]], requests=2, concurrency=2, max_tokens=2, k=None, one_at_a_time=False)
