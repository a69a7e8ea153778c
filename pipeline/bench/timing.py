"""Measured cost terms of a pair on this machine: draft/target step cost ratio c and the verify cost per K.

Each forward is timed the way the executor runs it: a KV cache already holding a prompt, new tokens appended, the
cache rolled back afterwards so every repeat sees the same context. Sizes are interleaved within each repeat so a
burst of load from another process hits all of them alike, and the median over repeats discards the bursts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass


@dataclass
class CostTerms:
    target_ms: float  # median target forward of 1 token with a warm cache
    draft_ms: float  # median draft forward of 1 token with a warm cache
    verify_ms: list[float]  # [k_max] median target forward of K+1 tokens, K = 1..k_max
    context_tokens: int  # tokens in the cache while timing
    repeats: int

    @property
    def cost_ratio_c(self) -> float:
        return self.draft_ms / self.target_ms

    @property
    def verify_cost_ratio(self) -> list[float]:
        """[k_max] target forward over K+1 tokens / over 1 token, K = 1..k_max."""
        return [v / self.target_ms for v in self.verify_ms]

    def verify_cost(self, k: int) -> float:
        """Verify cost ratio at K (1.0 at K=0: target-only decoding is one single-token forward)."""
        if k == 0:
            return 1.0
        if not 1 <= k <= len(self.verify_ms):
            raise ValueError(f"k: {k} was not measured (verify costs cover K=1..{len(self.verify_ms)})")
        return self.verify_ms[k - 1] / self.target_ms

    def to_dict(self) -> dict:
        return {**asdict(self), "cost_ratio_c": self.cost_ratio_c, "verify_cost_ratio": self.verify_cost_ratio}


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty sequence."""
    if not values:
        raise ValueError("percentile: no values; generate at least two tokens per prompt to measure latency")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


TIMING_SEQ = "cost-timing"  # the sequence the timings run on, in an otherwise idle engine


@contextmanager
def timing_sequence(runners, context: Sequence[int]):
    """Open TIMING_SEQ in each runner with ``context``'s KV (a realistic attention span), close it afterwards."""
    runners = [r for r in runners if r is not None]
    try:
        for runner in runners:
            runner.open(TIMING_SEQ, [])
            runner.forward([TIMING_SEQ], [list(context)], logits_for=[0])
        yield
    finally:
        for runner in runners:
            if TIMING_SEQ in runner.cache.lengths:
                runner.close(TIMING_SEQ)


def _time_forward(runner, context_len: int, tokens: list[int]) -> float:
    start = time.perf_counter()
    runner.forward([TIMING_SEQ], [tokens])
    elapsed = time.perf_counter() - start
    runner.truncate(TIMING_SEQ, context_len)
    return elapsed


def measure_costs(target, draft, context: Sequence[int], k_max: int, repeats: int = 15, warmup: int = 3
                  ) -> CostTerms:
    """Time single-token forwards of ``target`` and ``draft`` (the engine's BatchModelRunners, on a sequence of
    their own, so the engine must be idle) and K+1-token target forwards.

    ``context`` fills both caches first (a real prompt, so attention spans a realistic length). The appended
    tokens are the context's own first tokens: their values do not change the cost.
    """
    if k_max < 1:
        raise ValueError(f"k_max: {k_max} must be >= 1")
    context = list(context)
    if len(context) < k_max + 1:
        raise ValueError(f"context: {len(context)} tokens; need at least k_max + 1 = {k_max + 1} to append")
    single = {"target": [], "draft": []}
    verify: list[list[float]] = [[] for _ in range(k_max)]
    with timing_sequence([target, draft], context):  # no draft model (ngram): its cost is 0
        for rep in range(warmup + repeats):
            t = _time_forward(target, len(context), context[:1])
            d = _time_forward(draft, len(context), context[:1]) if draft is not None else 0.0
            widths = [_time_forward(target, len(context), context[:k + 1]) for k in range(1, k_max + 1)]
            if rep < warmup:
                continue  # first calls pay allocator and dispatch warm-up
            single["target"].append(t)
            single["draft"].append(d)
            for k, value in enumerate(widths):
                verify[k].append(value)
    ms = lambda xs: statistics.median(xs) * 1000.0  # noqa: E731
    return CostTerms(target_ms=ms(single["target"]), draft_ms=ms(single["draft"]),
                     verify_ms=[ms(v) for v in verify], context_tokens=len(context), repeats=repeats)


def measure_call_costs(target, draft, context: Sequence[int], k_max: int, repeats: int = 15, warmup: int = 3
                       ) -> CostTerms:
    """The same cost terms for engines behind the TrtllmRunner protocol (TensorRT-LLM): time whole engine calls.

    One call of ``generate(context, 1)`` is what the draft-target loop pays per single-token forward there (the
    request set-up included; KV-cache block reuse makes the repeated context cheap), and a verify call is the
    target handed K draft tokens (the context's own, so the comparison work is real).
    """
    from ..backends.trtllm_runner import Sampling

    if k_max < 1:
        raise ValueError(f"k_max: {k_max} must be >= 1")
    context = list(context)
    if len(context) < k_max + 2:
        raise ValueError(f"context: {len(context)} tokens; need at least k_max + 2 = {k_max + 2}")
    head, greedy = context[:-k_max - 1], Sampling()

    def timed(call) -> float:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    single = {"target": [], "draft": []}
    verify: list[list[float]] = [[] for _ in range(k_max)]
    for rep in range(warmup + repeats):
        t = timed(lambda: target.generate(head, 1, greedy))
        d = timed(lambda: draft.generate(head, 1, greedy)) if draft is not None else 0.0
        widths = [timed(lambda k=k: target.generate(head, k + 1, greedy, draft_tokens=context[len(head):][:k]))
                  for k in range(1, k_max + 1)]
        if rep < warmup:
            continue
        single["target"].append(t)
        single["draft"].append(d)
        for k, value in enumerate(widths):
            verify[k].append(value)
    ms = lambda xs: statistics.median(xs) * 1000.0  # noqa: E731
    return CostTerms(target_ms=ms(single["target"]), draft_ms=ms(single["draft"]),
                     verify_ms=[ms(v) for v in verify], context_tokens=len(head), repeats=repeats)

