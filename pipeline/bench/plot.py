"""The benchmark plot: one column per prompt set; on top the speedup over target-only against K, below the
acceptance of the swept method.

Each speedup panel draws the K sweep of the method under test (the draft model's, or the n-gram lookup's when there
is no draft model) with the range of its repeats, the analytic bound with the measured verify cost, and for every
other method one point: its best variant (median speedup, with its range), at its K (dynamic and adaptive K at the
mean K they drafted). Noisy cells (spread.py) are ringed in red; the best K of the sweep is circled and named in the
panel's title with the K values within its noise. The legend sits below the panels, outside the data; the figure's
title names the memory-bound limit and how close target-only came.
"""

from __future__ import annotations

import math
from pathlib import Path

from .spread import best_variant

# method -> (label, marker, colour, x offset so points at the same K stay apart)
POINTS = {
    "dynamic": ("dynamic K (at its mean K)", "D", "C1", -0.15),
    "adaptive": ("adaptive K, as served (at its mean K)", "s", "C2", 0.15),
    "ngram": ("n-gram lookup", "^", "C3", -0.2),
    "ngram+draft": ("n-gram or draft, per step", "v", "C4", 0.2),
    "medusa": ("Medusa heads (K = tree depth)", "P", "C5", 0.0),
    "suffix": ("suffix decoding", "h", "C9", -0.25),
    "eagle3": ("EAGLE-3 heads", "p", "tab:olive", 0.05),
    "hf_assisted": ("HF assisted generation, its best K", "X", "C6", 0.1),
    "hf_lookup": ("HF prompt lookup", "*", "C8", 0.25),
    "hf_target": ("HF generate(), target only", "x", "C7", 0.15),
}
SWEEP_COLOUR = "C0"
PANEL_COLUMNS = 4


def swept_method(rows: list[dict]) -> str:
    """The method whose K sweep a panel draws: the draft model's when there is one, else the n-gram lookup's."""
    return "speculative" if any(r["method"] == "speculative" for r in rows) else "ngram"


def plot_results(records: list[dict], out: Path, title: str) -> Path:
    """Write the PNG: one column per prompt set (records' `set`), wrapping after PANEL_COLUMNS sets."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(r.get("set", r["prompt_set"]) for r in records))
    columns, set_rows = min(len(sets), PANEL_COLUMNS), math.ceil(len(sets) / PANEL_COLUMNS)
    fig = plt.figure(figsize=(4.4 * columns + 0.6, 4.8 * set_rows + 0.4))
    grid = fig.add_gridspec(2 * set_rows, columns, height_ratios=[3, 1] * set_rows)
    legend: dict[str, object] = {}
    for i, name in enumerate(sets):
        row, column = divmod(i, PANEL_COLUMNS)
        ax_speed = fig.add_subplot(grid[2 * row, column])
        ax_acc = fig.add_subplot(grid[2 * row + 1, column], sharex=ax_speed)
        rows = [r for r in records if r.get("set", r["prompt_set"]) == name]
        speedup_panel(ax_speed, name, rows, legend)
        acceptance_panel(ax_acc, rows, legend)
    if legend:
        fig.legend(legend.values(), legend.keys(), loc="upper center", bbox_to_anchor=(0.5, 0.0),
                   ncol=2 if columns == 1 else 4, fontsize=8, frameon=False)
    return save_figure(fig, out, title + memory_bound_note(records))


def speedup_panel(ax, name: str, rows: list[dict], legend: dict) -> None:
    """One set's speedups: the sweep with its range and bound, the best of every other method, target and
    llama.cpp as horizontal lines."""
    swept = swept_method(rows)
    sweep = sorted((r for r in rows if r["method"] == swept and isinstance(r["k"], int)
                    and r.get("speedup_vs_target") is not None), key=lambda r: r["k"])
    legend.setdefault("target only, our runtime (= 1)", ax.axhline(1.0, color="black", linewidth=1))
    best = _draw_sweep(ax, swept, sweep, legend) if sweep else ""
    for method, (label, marker, colour, offset) in POINTS.items():
        pick = best_variant([r for r in rows if r["method"] == method]) if method != swept else None
        if pick is None:
            continue
        r = pick.record
        x = (r["k"] if isinstance(r["k"], int) else r.get("mean_draft_len") or 0) + offset
        legend.setdefault(label, _point(ax, x, r, marker, colour))
        _ring_if_noisy(ax, x, r, legend)
    target = next((r for r in rows if r["method"] == "target"), None)
    for r in rows:
        if r["method"] == "llamacpp" and target and target["tokens_per_s"]:
            # In speedup units: llama.cpp's plain decoding over ours, so every line reads against the same 1.0.
            label = f"llama.cpp {r.get('precision')} plain decoding"
            legend.setdefault(label, ax.axhline(r["tokens_per_s"] / target["tokens_per_s"], color="C9",
                                                linestyle="-.", linewidth=1.5, label=label))
    rate = f", target only {target['tokens_per_s']:.1f} tok/s" if target and target.get("tokens_per_s") else ""
    ax.set_title(f"{name}{rate}" + (f"\n{best}" if best else ""), fontsize=10)
    medians = [r["speedup_vs_target"] for r in rows if r.get("speedup_vs_target") is not None]
    # A burst of load can stretch one range tenfold; the medians set the scale and such a range runs off the top
    # (its cell is ringed as noisy anyway).
    ax.set_ylim(0, 1.3 * max([1.0, *medians, *(r.get("bound_speedup_refined") or 0 for r in sweep)]))
    ks = [r["k"] for r in rows if isinstance(r["k"], int)] + [r.get("mean_draft_len") or 0 for r in rows]
    ax.set_xlim(-0.5, max(ks, default=1) + 0.6)
    ax.set_ylabel("speedup vs target only")
    ax.grid(alpha=0.3)


def _draw_sweep(ax, swept: str, sweep: list[dict], legend: dict) -> str:
    """The sweep with its range, its bound and its noisy cells; returns what the title says of its best K."""
    ks = [r["k"] for r in sweep]
    medians = [r["speedup_vs_target"] for r in sweep]
    low, high = zip(*(_error_bar(r) for r in sweep))
    label = ("draft model" if swept == "speculative" else "n-gram lookup") + " at K (median, range of repeats)"
    legend.setdefault(label, ax.errorbar(ks, medians, yerr=[low, high], fmt="o-", color=SWEEP_COLOUR, capsize=3))
    bounds = [(r["k"], r["bound_speedup_refined"]) for r in sweep if r.get("bound_speedup_refined") is not None]
    if bounds:
        line, = ax.plot(*zip(*bounds), "--", color=SWEEP_COLOUR, alpha=0.5)
        legend.setdefault("bound with measured c and verify cost", line)
    for r in sweep:
        _ring_if_noisy(ax, r["k"], r, legend)
    pick = best_variant(sweep)
    best = pick.record
    highlight, = ax.plot([best["k"]], [best["speedup_vs_target"]], "o", markersize=14, markerfacecolor="none",
                         markeredgecolor=SWEEP_COLOUR, markeredgewidth=2)
    legend.setdefault("best K, by median (named in the panel's title)", highlight)
    ax.set_xticks(sorted({0, *ks}))
    return (f"best {'draft model' if swept == 'speculative' else 'n-gram'} K={best['k']} "
            f"{best['speedup_vs_target']:.2f}x"
            + (f", within noise of K={', '.join(str(r['k']) for r in pick.rivals if r['method'] == swept)}"
               if pick.rivals else ""))


def _error_bar(record: dict) -> tuple[float, float]:
    """How far the repeats' range reaches below and above the record's speedup (never negative: the speedup is
    the ratio of median rates and the range the per-repeat ratios, each rounded, so with repeats that agree the
    speedup can sit a rounding step outside the range)."""
    median = record["speedup_vs_target"]
    low = record.get("speedup_min") if record.get("speedup_min") is not None else median
    high = record.get("speedup_max") if record.get("speedup_max") is not None else median
    return max(0.0, median - low), max(0.0, high - median)


def _point(ax, x: float, record: dict, marker: str, colour: str):
    low, high = _error_bar(record)
    return ax.errorbar([x], [record["speedup_vs_target"]], yerr=[[low], [high]], fmt=marker, color=colour,
                       markersize=12 if marker == "*" else 8, capsize=3)


def _ring_if_noisy(ax, x: float, record: dict, legend: dict) -> None:
    if record.get("noisy"):
        ring = ax.scatter([x], [record["speedup_vs_target"]], s=260, facecolors="none", edgecolors="red",
                          linewidths=1.5, zorder=5)
        legend.setdefault("noisy cell (repeats spread, or off its K trend)", ring)


def acceptance_panel(ax, rows: list[dict], legend: dict) -> None:
    """The swept method's accepted/drafted and per-token alpha against K."""
    swept = swept_method(rows)
    sweep = sorted((r for r in rows if r["method"] == swept and isinstance(r["k"], int)), key=lambda r: r["k"])
    if sweep:
        ks = [r["k"] for r in sweep]
        line, = ax.plot(ks, [r["acceptance_rate"] for r in sweep], "o-", color=SWEEP_COLOUR, markersize=4)
        legend.setdefault("accepted / drafted (lower panels)", line)
        line, = ax.plot(ks, [r["alpha"] for r in sweep], "s:", color="grey", markersize=4)
        legend.setdefault("alpha, per-token acceptance (lower panels)", line)
    ax.set(xlabel="K (draft tokens per target step)", ylabel="acceptance", ylim=(0, 1.02))
    ax.grid(alpha=0.3)


def memory_bound_note(records: list[dict]) -> str:
    """The memory-bound limit and target-only's share of it per set, for the title ("" when not measured)."""
    targets = [r for r in records if r["method"] == "target" and r.get("fraction_of_memory_bound")]
    if not targets:
        return ""
    limit = targets[0]["tokens_per_s"] / targets[0]["fraction_of_memory_bound"]
    return (f"\nmemory-bound limit {limit:.0f} tok/s; target only reached "
            + ", ".join(f"{r['prompt_set']} {r['fraction_of_memory_bound']:.2f}" for r in targets) + " of it")


def save_figure(fig, out: Path, title: str) -> Path:
    """Title, lay out and write a benchmark figure as PNG, then free it (figures are never shown); the saved area
    grows to hold a legend placed outside the axes."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out
