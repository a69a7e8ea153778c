"""pipeline/bench/plot.py: one speedup panel per prompt set, the sweep with its range, one point (the best variant)
for every other method, Hugging Face prompt lookup drawn, noisy cells ringed, and the legend outside the data."""

from __future__ import annotations

import pytest

import pipeline.bench.plot as plot
from pipeline.bench.records import finish_records


def _record(name, method, k, rate, low=None, high=None, **extra):
    return {"method": method, "k": k, "set": name, "prompt_set": name, "tokens_per_s": rate,
            "tokens_per_s_by_repeat": [rate if low is None else low, rate, rate if high is None else high],
            "bound_speedup": 1.5, "bound_speedup_refined": 1.3, "acceptance_rate": 0.5, "alpha": 0.6,
            "mean_draft_len": 3.0, "repeats": 3, **extra}


def _records():
    records = []
    for name in ("code", "prose"):
        records.append(_record(name, "target", 0, 10.0))
        records += [_record(name, "ngram", k, rate) for k, rate in ((1, 9.0), (2, 11.0), (4, 13.0), (8, 12.0))]
        records += [_record(name, "hf_assisted", k, rate) for k, rate in ((1, 8.0), (2, 9.5), (4, 9.0))]
        records += [_record(name, "hf_lookup", 8, 11.5), _record(name, "hf_target", 0, 9.8),
                    _record(name, "adaptive", "policy", 12.5, 6.0, 14.0)]  # a wide spread: noisy
    return finish_records(records)


@pytest.fixture
def figure(monkeypatch, tmp_path):
    figures = []
    monkeypatch.setattr(plot, "save_figure", lambda fig, out, title: figures.append(fig) or out)
    plot.plot_results(_records(), tmp_path / "p.png", "t")
    return figures[0]


def _points(ax, method):
    """x values of ``method``'s points on ``ax`` (its marker in its colour)."""
    _, marker, colour, _ = plot.POINTS[method]
    return [line.get_xdata()[0] for line in ax.get_lines()
            if line.get_color() == colour and line.get_marker() == marker]


def test_one_speedup_and_one_acceptance_panel_per_set(figure):
    speed = figure.axes[0::2]
    assert len(figure.axes) == 4 and [ax.get_title().split(",")[0] for ax in speed] == ["code", "prose"]


def test_the_best_variant_of_each_other_method_is_one_point(figure):
    offset = {method: spec[3] for method, spec in plot.POINTS.items()}
    for ax in figure.axes[0::2]:
        assert _points(ax, "hf_assisted") == [pytest.approx(2 + offset["hf_assisted"])]  # its best K, not every K
        assert _points(ax, "hf_lookup") == [pytest.approx(8 + offset["hf_lookup"])]
        assert _points(ax, "adaptive") == [pytest.approx(3.0 + offset["adaptive"])]  # at the mean K it drafted
        assert _points(ax, "ngram") == []  # the swept method is the line, not a point
        sweep = [line for line in ax.get_lines() if line.get_color() == plot.SWEEP_COLOUR
                 and line.get_linestyle() == "-" and list(line.get_xdata()) == [1, 2, 4, 8]]
        assert sweep and list(sweep[0].get_ydata()) == pytest.approx([0.9, 1.1, 1.3, 1.2])


def test_the_legend_names_hf_lookup_once_and_sits_below_every_panel(figure):
    assert all(ax.get_legend() is None for ax in figure.axes)
    (legend,) = figure.legends
    labels = [text.get_text() for text in legend.get_texts()]
    assert labels.count("HF prompt lookup") == 1 and "noisy cell (repeats spread, or off its K trend)" in labels
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    top_of_legend = legend.get_window_extent(renderer).y1
    assert all(top_of_legend < ax.get_tightbbox(renderer).y0 for ax in figure.axes)


def test_noisy_cells_are_ringed(figure):
    rings = [c for c in figure.axes[0].collections if c.get_edgecolor().tolist() == [[1.0, 0.0, 0.0, 1.0]]]
    assert len(rings) == 1  # adaptive's repeats spread 64%; nothing else is noisy


def test_the_png_is_written(tmp_path):
    out = plot.plot_results(_records(), tmp_path / "p.png", "t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_speedup_a_rounding_step_outside_its_repeats_range_still_plots(tmp_path):
    """The speedup is the ratio of median rates, the range the per-repeat ratios, each rounded: with repeats that
    agree the speedup can sit just outside the range (a bench run died drawing a negative error bar)."""
    records = _records()
    for record in records:
        if record["method"] in ("ngram", "adaptive"):
            record["speedup_min"] = record["speedup_max"] = record["speedup_vs_target"] - 0.0002
    out = plot.plot_results(records, tmp_path / "p.png", "t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
