"""How far a benchmark cell can be trusted: the spread of its repeats, noisy cells, and a best pick that says
when it is within noise.

A cell is one (set, method, K). Its speedup is its median rate over target-only's median rate. Its range pairs each
repeat with target-only's rate in the same repeat (repeats are interleaved, so a machine whose speed drifts over
minutes slows both alike and the pair cancels the drift; a burst within one repeat does not cancel): the slowest and
the fastest of those per-repeat speedups. (They hold the median one: every rate lies between the slowest and the
fastest ratio times its pair, so the medians do too.) A cell is noisy when
  its per-repeat speedups spread by more than NOISY_SPREAD of its speedup, or
  it breaks the trend of its K neighbours: below both, or above both, by more than TREND_BREAK of their mean
  (a real speedup curve over K rises, peaks and falls without a lone dip or spike that size; the cost of a
  verify does vary with K, which is why the margin is wide).
Target-only's own rate_spread (its rates over the repeats, unpaired) says how much the machine drifted.
The best variant of a method is picked by median speedup; it is "within noise" of every other variant whose range
reaches the best one's range, and with one repeat there is no range at all, which the summary says.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NOISY_SPREAD = 0.2  # (fastest - slowest repeat) / median rate
TREND_BREAK = 0.25  # distance from the neighbours' mean, as a share of it


def add_spread(record: dict, base: dict) -> None:
    """rate_spread, speedup_by_repeat, speedup_min / speedup_max and spread of one record that has
    tokens_per_s_by_repeat and speedup_vs_target, against ``base``, target-only's record of the same set."""
    rates, base_rates = record.get("tokens_per_s_by_repeat"), base.get("tokens_per_s_by_repeat")
    median = record["tokens_per_s"]
    record["rate_spread"] = round((max(rates) - min(rates)) / median, 4) if rates and median else None
    speedup = record.get("speedup_vs_target")
    if not rates or not base_rates or len(rates) != len(base_rates) or not all(base_rates) or not speedup:
        record.update(speedup_by_repeat=None, speedup_min=None, speedup_max=None, spread=None)
        return
    paired = [rate / base_rate for rate, base_rate in zip(rates, base_rates)]
    low, high = min(paired), max(paired)
    record.update(speedup_by_repeat=[round(x, 4) for x in paired], speedup_min=round(low, 4),
                  speedup_max=round(high, 4), spread=round((high - low) / speedup, 4))


def flag_noisy(records: list[dict]) -> list[dict]:
    """Set ``noisy`` (bool) and ``noise`` (why, or None) on every record; returns the records."""
    for record in records:
        reasons = []
        if record.get("spread") is not None and record["spread"] > NOISY_SPREAD:
            reasons.append(f"repeats spread {record['spread']:.0%}")
        record["noise"], record["noisy"] = reasons, bool(reasons)
    for row in _sweeps(records):
        for left, cell, right in zip(row, row[1:], row[2:]):
            reason = trend_break(left["speedup_vs_target"], cell["speedup_vs_target"], right["speedup_vs_target"])
            if reason:
                cell["noise"].append(f"{reason} (K={left['k']} and K={right['k']})")
                cell["noisy"] = True
    for record in records:
        record["noise"] = "; ".join(record["noise"]) or None
    return records


def trend_break(left: float, middle: float, right: float) -> str | None:
    """Why ``middle`` breaks the trend of its neighbours, or None when it does not."""
    mean = (left + right) / 2
    outside = middle < min(left, right) or middle > max(left, right)
    if outside and mean > 0 and abs(middle - mean) > TREND_BREAK * mean:
        return f"{middle:.2f}x between {left:.2f}x and {right:.2f}x"
    return None


def _sweeps(records: list[dict]) -> list[list[dict]]:
    """Per (set, method): its records with an integer K and a speedup, in K order (the rows a trend runs along)."""
    rows: dict[tuple, list[dict]] = {}
    for r in records:
        if isinstance(r.get("k"), int) and r.get("speedup_vs_target") is not None:
            rows.setdefault((r.get("set", r.get("prompt_set")), r["method"]), []).append(r)
    return [sorted(row, key=lambda r: r["k"]) for row in rows.values() if len(row) >= 3]


@dataclass
class BestPick:
    record: dict  # the variant with the highest median speedup
    rivals: list[dict] = field(default_factory=list)  # other variants whose range reaches the best one's
    repeats: int = 1

    def describe(self) -> str:
        """"K=4 1.30x (1.21-1.38x over 3 repeats); within noise of K=3 1.27x" or the like."""
        best = self.record
        text = f"K={best['k']} {best['speedup_vs_target']:.2f}x"
        if self.repeats < 2 or best.get("speedup_min") is None:
            return text + " (1 repeat: no spread measured; --repeats 3 or more to pick K robustly)"
        text += f" ({best['speedup_min']:.2f}-{best['speedup_max']:.2f}x over {self.repeats} repeats)"
        if self.rivals:
            text += "; within noise of " + ", ".join(
                ("" if r["method"] == best["method"] else f"{r['method']} ")
                + f"K={r['k']} {r['speedup_vs_target']:.2f}x" for r in self.rivals)
        if best.get("noisy"):
            text += f"; noisy: {best['noise']}"
        return text


def best_variant(rows: list[dict]) -> BestPick | None:
    """The variant of one method (one set) with the highest median speedup, and the variants within its noise."""
    rows = [r for r in rows if r.get("speedup_vs_target") is not None]
    if not rows:
        return None
    best = max(rows, key=lambda r: r["speedup_vs_target"])
    low = best.get("speedup_min")
    rivals = [] if low is None else [r for r in rows if r is not best and r.get("speedup_max") is not None
                                     and r["speedup_max"] >= low]
    rivals.sort(key=lambda r: -r["speedup_vs_target"])
    return BestPick(best, rivals, best.get("repeats", 1))
