"""What bench-serve reports about speculation per cell, beside speed: the field's figures.

  acceptance length   per request, 1 + accepted / verify steps (the tokens one target step emitted on average);
                      the cell's mean over requests and its histogram (requests per bin of HISTOGRAM_BIN); where
                      the path reports every step, also how many steps emitted 1, 2, ... tokens (the histogram
                      specdec_bench reports)
  per-position        for draft position i (1-based), the share of the steps that drafted a token there whose token
                      the target kept: accepted_at[i] / drafted_at[i], from the requests' own counts where the path
                      returns them, else from the engine's totals (Triton's position counters) over the cell
  exact match         the share of requests whose greedy output equals speculation off's for the same prompt on the
                      same path and concurrency: the lossless check under load (a batch can change float rounding,
                      so a near-tie may flip; a method that is wrong shows up far below 1)
  weight GB/s         target weight bytes x engine steps / wall: how close the server runs to the memory wall
  spread              a cell's repeats: min / median / max tokens/s, and whether every repeat is within SPREAD_GOAL
                      of the median (the benchmark's own reproducibility goal)
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from .request_timing import RequestTiming

HISTOGRAM_BIN = 0.25  # acceptance-length bin width, tokens per step
SPREAD_GOAL = 0.05  # every repeat within +-5% of the median


def acceptance_summary(timings: Sequence[RequestTiming]) -> dict:
    """acceptance_length (mean over requests that ran a step), acceptance_length_per_request and its histogram."""
    lengths = [1.0 + t.accepted / t.steps for t in timings if t.steps]
    if not lengths:
        return {"acceptance_length": None, "acceptance_length_per_request": [], "acceptance_length_histogram": None,
                "tokens_per_step_histogram": None}
    bins = int(max(lengths) / HISTOGRAM_BIN) + 1
    first = int(1.0 / HISTOGRAM_BIN)
    counts = [0] * (bins - first)
    for length in lengths:
        counts[int(length / HISTOGRAM_BIN) - first] += 1
    edges = [round((first + i) * HISTOGRAM_BIN, 4) for i in range(len(counts) + 1)]
    return {"acceptance_length": round(sum(lengths) / len(lengths), 4),
            "acceptance_length_per_request": [round(x, 4) for x in lengths],
            "acceptance_length_histogram": {"edges": edges, "counts": counts},
            "tokens_per_step_histogram": step_histogram(timings)}


def step_histogram(timings: Sequence[RequestTiming]) -> dict[str, int] | None:
    """How many target steps emitted each number of tokens, over the requests whose every step was reported (keys
    as strings, in order: JSON's form); None when no request's were."""
    counts: dict[int, int] = {}
    for timing in timings:
        for tokens in timing.step_tokens or []:
            counts[tokens] = counts.get(tokens, 0) + 1
    return {str(tokens): counts[tokens] for tokens in sorted(counts)} or None


def position_rates(drafted_at: Sequence[float], accepted_at: Sequence[float]) -> list[float | None] | None:
    """accepted / drafted per draft position, up to the last position that drafted anything; None when none did."""
    drafted = list(drafted_at)
    while drafted and not drafted[-1]:
        drafted.pop()
    rates = [round(a / d, 4) if d else None for d, a in zip(drafted, accepted_at)]
    return rates or None


def request_positions(timings: Sequence[RequestTiming]) -> list[float | None] | None:
    """Per-position acceptance summed over the requests that carry their own position counts (None: none do)."""
    carried = [t for t in timings if t.drafted_at is not None]
    if not carried:
        return None
    width = max((len(t.drafted_at) for t in carried), default=0)
    drafted, accepted = [0] * width, [0] * width
    for t in carried:
        for i, (d, a) in enumerate(zip(t.drafted_at, t.accepted_at)):
            drafted[i] += d
            accepted[i] += a
    return position_rates(drafted, accepted)


def exact_match(outputs: Sequence[object], reference: Sequence[object]) -> float | None:
    """The share of requests (by index: request i sent the same prompt in both cells) whose output equals the
    reference's; None when either side could not return outputs."""
    if not outputs or len(outputs) != len(reference) or any(o is None for o in (*outputs, *reference)):
        return None
    return round(sum(a == b for a, b in zip(outputs, reference)) / len(outputs), 4)


def spread(rates: Sequence[float]) -> dict:
    """min / median / max of a cell's repeats and whether all lie within SPREAD_GOAL of the median."""
    median = statistics.median(rates)
    return {"tokens_per_s_min": round(min(rates), 2), "tokens_per_s_median": round(median, 2),
            "tokens_per_s_max": round(max(rates), 2), "rounds": [round(r, 2) for r in rates],
            "within_spread_goal": bool(median) and all(abs(r - median) <= SPREAD_GOAL * median for r in rates)}


def median_round(rounds: Sequence[dict]) -> dict:
    """The round whose tokens/s is the (lower) median: the cell's representative record."""
    ordered = sorted(rounds, key=lambda r: r["tokens_per_s"])
    return ordered[(len(ordered) - 1) // 2]
