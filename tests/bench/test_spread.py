"""pipeline/bench/spread.py: the spread of a cell's repeats, noisy cells (wide spread, or off the K trend), and the
best variant picked by median with the variants within its noise."""

from __future__ import annotations

import pytest

from pipeline.bench.spread import NOISY_SPREAD, add_spread, best_variant, flag_noisy, trend_break


TARGET = {"tokens_per_s": 10.0, "tokens_per_s_by_repeat": [10.0, 10.0, 10.0]}


def _cell(k, median, low=None, high=None, method="ngram", repeats=3):
    """A cell whose repeats ran at ``low``, ``median`` and ``high`` times target-only's steady 10 tok/s."""
    low = median if low is None else low
    high = median if high is None else high
    by_repeat = [low * 10, median * 10, high * 10][:repeats] if repeats > 1 else [median * 10]
    return {"method": method, "k": k, "set": "code", "prompt_set": "code", "tokens_per_s": median * 10,
            "tokens_per_s_by_repeat": by_repeat, "speedup_vs_target": median, "repeats": repeats}


def _with_spread(*cells):
    for cell in cells:
        add_spread(cell, {**TARGET, "tokens_per_s_by_repeat": [10.0] * cell["repeats"]})
    return flag_noisy(list(cells))


def test_each_repeat_is_paired_with_target_only_in_the_same_repeat():
    cell = {"tokens_per_s": 12.0, "tokens_per_s_by_repeat": [9.0, 12.0, 15.0], "speedup_vs_target": 1.2}
    add_spread(cell, {"tokens_per_s": 10.0, "tokens_per_s_by_repeat": [10.0, 10.0, 12.0]})
    assert cell["speedup_by_repeat"] == [0.9, 1.2, 1.25]
    assert (cell["speedup_min"], cell["speedup_max"]) == (0.9, 1.25)
    assert cell["spread"] == pytest.approx((1.25 - 0.9) / 1.2, abs=1e-4) and cell["rate_spread"] == 0.5
    # The machine slowed down over the run: every method's rate halved, the pairs did not move.
    drift = {"tokens_per_s": 15.0, "tokens_per_s_by_repeat": [20.0, 15.0, 10.0], "speedup_vs_target": 1.0}
    add_spread(drift, {"tokens_per_s": 15.0, "tokens_per_s_by_repeat": [20.0, 15.0, 10.0]})
    assert drift["spread"] == 0.0 and drift["rate_spread"] == pytest.approx(10 / 15, abs=1e-4)
    assert not flag_noisy([drift])[0]["noisy"]
    add_spread(missing := {"tokens_per_s": 12.0, "speedup_vs_target": 1.2}, TARGET)  # no repeats: llama.cpp's
    assert missing["speedup_min"] is None and missing["spread"] is None


@pytest.mark.parametrize("rates, base", [([11.0, 12.0, 13.0], [8.0, 9.0, 11.0]), ([1.0, 10.0, 10.0], [1.0, 1.0, 10.0]),
                                         ([30.0, 5.0, 12.0], [10.0, 9.0, 2.0])])
def test_the_range_holds_the_median_speedup(rates, base):
    import statistics

    speedup = round(statistics.median(rates) / statistics.median(base), 4)
    cell = {"tokens_per_s": statistics.median(rates), "tokens_per_s_by_repeat": rates, "speedup_vs_target": speedup}
    add_spread(cell, {"tokens_per_s": statistics.median(base), "tokens_per_s_by_repeat": base})
    assert cell["speedup_min"] <= speedup <= cell["speedup_max"]


def test_a_wide_spread_is_noisy_and_a_narrow_one_is_not():
    wide, narrow = _with_spread(_cell(1, 1.0, 0.8, 1.3), _cell(2, 1.0, 0.95, 1.05))
    assert wide["spread"] > NOISY_SPREAD and wide["noisy"] and "repeats spread 50%" in wide["noise"]
    assert not narrow["noisy"] and narrow["noise"] is None


def test_a_lone_dip_between_two_neighbours_breaks_the_trend():
    """The new-user trial: one repeat gave 0.31x between two 1.35x neighbours."""
    left, dip, right = _with_spread(_cell(3, 1.35), _cell(4, 0.31), _cell(5, 1.35))
    assert dip["noisy"] and "0.31x between 1.35x and 1.35x (K=3 and K=5)" in dip["noise"]
    assert not left["noisy"] and not right["noisy"]  # the ends have one neighbour: never judged


@pytest.mark.parametrize("left, middle, right", [
    (1.0, 1.2, 1.4),  # a rising curve
    (0.88, 0.82, 1.07),  # a real dip from the verify cost of 2- and 3-token forwards (SmolLM2 json, 2 cores)
    (1.0, 1.3, 1.1),  # a peak: what a speedup curve over K has
    (1.0, 1.9, 2.0),  # a steep rise that flattens: far from the neighbours' mean, but between them
])
def test_shapes_a_real_curve_has_are_not_trend_breaks(left, middle, right):
    assert trend_break(left, middle, right) is None


def test_the_trend_is_read_per_set_and_method_in_k_order():
    cells = [_cell(4, 0.31), _cell(1, 1.35), _cell(8, 1.35), _cell(2, 0.31, method="speculative")]
    flag_noisy(cells)
    assert cells[0]["noisy"]  # K 1, 4, 8 in order, whatever order the records came in
    assert not cells[3]["noisy"]  # another method: not a neighbour


def test_best_is_the_highest_median_not_the_luckiest_repeat():
    lucky = _cell(2, 1.0, 0.4, 2.0)  # one fast repeat: its max beats everything, its median does not
    steady = _cell(4, 1.3, 1.25, 1.35)
    close = _cell(8, 1.28, 1.2, 1.3)
    _with_spread(lucky, steady, close)
    pick = best_variant([lucky, steady, close])
    assert pick.record is steady
    assert pick.rivals == [close, lucky]  # both ranges reach 1.25, the best one's slowest repeat
    text = pick.describe()
    assert text.startswith("K=4 1.30x (1.25-1.35x over 3 repeats); within noise of K=8 1.28x, K=2 1.00x")


def test_a_clear_best_is_not_within_noise_and_one_repeat_says_it_measured_no_spread():
    best, other = _with_spread(_cell(4, 1.5, 1.45, 1.55), _cell(2, 1.1, 1.05, 1.2))
    pick = best_variant([best, other])
    assert pick.rivals == [] and "within noise" not in pick.describe()
    single = _with_spread(_cell(1, 1.2, repeats=1), _cell(2, 1.1, repeats=1))
    assert "1 repeat: no spread measured" in best_variant(single).describe()
    assert best_variant([]) is None
