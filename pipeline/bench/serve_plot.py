"""The serving benchmark's plot: throughput, inter-token latency and TTFT against concurrency, per mode and path."""

from __future__ import annotations

from pathlib import Path

from .plot import save_figure

PATH_STYLES = {"engine": "o-", "triton": "s--", "triton_stream": "^:", "openai": "d-."}


def plot_serving(records: list[dict], out: Path, title: str) -> Path:
    """Four panels against the number of concurrent clients: tokens/s, ITL p99, TTFT p99 (log scales) and the mean
    acceptance length per request."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for r in records))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    panels = (("tokens_per_s", "tokens/s (all clients)"), ("itl_ms_p99", "inter-token latency p99 (ms)"),
              ("ttft_ms_p99", "time to first token p99 (ms)"),
              ("acceptance_length", "acceptance length (tokens per step)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(21, 4.8))
    for ax, (key, label) in zip(axes, panels):
        for path in dict.fromkeys(r["path"] for r in records):
            for i, mode in enumerate(modes):
                rows = sorted((r for r in records if r["path"] == path and r["mode"] == mode
                               and r.get(key) is not None), key=lambda r: r["concurrency"])
                if rows:
                    ax.plot([r["concurrency"] for r in rows], [r[key] for r in rows],
                            PATH_STYLES.get(path, "x-"), color=colours[i % len(colours)], label=f"{path}: {mode}")
        ax.set(xlabel="concurrent clients", ylabel=label, xscale="log",
               yscale="linear" if key == "acceptance_length" else "log")
        ax.set_xticks(sorted({r["concurrency"] for r in records}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    return save_figure(fig, out, title)
