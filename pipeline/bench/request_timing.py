"""One request's timing as its client saw it, and a load's timings summarized into rates and percentiles."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .timing import percentile


@dataclass
class RequestTiming:
    """One request as its client saw it; times in seconds from the client's send."""

    tokens: int = 0
    first_s: float | None = None  # first token arrived (None: the path cannot tell)
    last_s: float = 0.0  # the response completed
    itl_s: list[float] = field(default_factory=list)  # [tokens after the first step] per-token gaps
    error: str | None = None
    drafted: int = 0  # draft tokens proposed, accepted by the target, and target steps (the request's stats)
    accepted: int = 0
    steps: int = 0
    drafted_at: list[int] | None = None  # per draft position, where the path returns them (None: it does not)
    accepted_at: list[int] | None = None
    output: list[int] | str | None = None  # the generated ids (or text where a path returns only text)
    # Tokens each target step emitted, where the path reports every step's totals (None: it does not, or one report
    # covered several steps).
    step_tokens: list[int] | None = None
    started: float = field(default_factory=time.perf_counter)  # perf_counter at send

    def queued_since(self, queued: float) -> None:
        """Count a wait before the send (one-at-a-time's lock) into TTFT and latency, as the client saw it."""
        wait = self.started - queued
        self.first_s = None if self.first_s is None else self.first_s + wait
        self.last_s += wait

    def take_stats(self, drafted: int, accepted: int, steps: int, drafted_at: list[int] | None = None,
                   accepted_at: list[int] | None = None) -> None:
        """The request's running totals as its latest response reported them; a report one step after the last
        adds that step's tokens to ``step_tokens`` (the first report starts it, a jump of several steps ends it)."""
        if steps == self.steps + 1 and (self.steps == 0 or self.step_tokens is not None):
            if self.step_tokens is None:
                self.step_tokens = []
            self.step_tokens.append(1 + accepted - self.accepted)
        elif steps != self.steps:
            self.step_tokens = None
        self.drafted, self.accepted, self.steps = drafted, accepted, steps
        if drafted_at is not None:
            self.drafted_at, self.accepted_at = list(drafted_at), list(accepted_at or [])

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last - first) / (tokens - 1); None where TTFT is unknown."""
        if self.first_s is None or self.tokens < 2:
            return None
        return (self.last_s - self.first_s) / (self.tokens - 1)


class TokenArrivals:
    """Turns arrival times of token groups into a RequestTiming (a group of n after a gap t: n gaps of t / n)."""

    def __init__(self) -> None:
        self.timing = RequestTiming()
        self.start = self.timing.started
        self._last: float | None = None

    def arrived(self, count: int, now: float | None = None, ids: list[int] | None = None) -> None:
        """``count`` tokens arrived at ``now`` (default: now); ``ids``, where the path returns them, are kept as the
        request's output."""
        now = time.perf_counter() if now is None else now
        if ids is not None:
            if self.timing.output is None:
                self.timing.output = []
            self.timing.output.extend(ids)
        if count <= 0:
            return
        if self._last is None:
            self.timing.first_s = now - self.start
        else:
            self.timing.itl_s.extend([(now - self._last) / count] * count)
        self._last = now
        self.timing.tokens += count

    def done(self) -> RequestTiming:
        self.timing.last_s = time.perf_counter() - self.start
        return self.timing


def summarize(timings: list[RequestTiming], wall_s: float) -> dict:
    """One load's record: tokens/s and requests/s over ``wall_s``, ITL, TTFT, TPOT (per request, after its first
    token) and latency p50/p99 in ms, and the mean K and acceptance rate over every request's steps."""
    tokens = sum(t.tokens for t in timings)
    itl = [x for t in timings for x in t.itl_s]
    firsts = [t.first_s for t in timings if t.first_s is not None]
    latency = [t.last_s for t in timings]

    def ms(values: list[float], q: float) -> float | None:
        return round(1000 * percentile(values, q), 3) if values else None

    tpot = [t.tpot_s for t in timings if t.tpot_s is not None]
    drafted, steps = sum(t.drafted for t in timings), sum(t.steps for t in timings)
    return {"requests": len(timings), "tokens": tokens, "wall_s": round(wall_s, 4),
            "mean_draft_len": round(drafted / steps, 3) if steps else None,
            "acceptance_rate": round(sum(t.accepted for t in timings) / drafted, 3) if drafted else None,
            "tokens_per_s": round(tokens / wall_s, 2), "requests_per_s": round(len(timings) / wall_s, 3),
            "itl_ms_p50": ms(itl, 50), "itl_ms_p99": ms(itl, 99),
            "ttft_ms_p50": ms(firsts, 50), "ttft_ms_p99": ms(firsts, 99),
            "tpot_ms_p50": ms(tpot, 50), "tpot_ms_p99": ms(tpot, 99),
            "latency_ms_p50": ms(latency, 50), "latency_ms_p99": ms(latency, 99)}
