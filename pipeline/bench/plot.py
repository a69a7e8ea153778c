"""The benchmark plot: speedup and acceptance against K, with target-only, dynamic-K, adaptive-K, Hugging Face and
llama.cpp lines; the title names the memory-bound limit and how close target-only decoding came to it."""

from __future__ import annotations

from pathlib import Path


def plot_results(records: list[dict], out: Path, title: str) -> Path:
    """Write a PNG with two panels (speedup vs K, acceptance vs K), one colour per prompt set. The K sweep is the
    draft model's (method speculative), or the n-gram lookup's when there is no draft model."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(r["prompt_set"] for r in records))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, (ax_speed, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.8))
    ax_speed.axhline(1.0, color="black", linewidth=1, label="target only (our runtime)")
    for i, name in enumerate(sets):
        colour = colours[i % len(colours)]
        rows = [r for r in records if r["prompt_set"] == name]
        swept = "speculative" if any(r["method"] == "speculative" for r in rows) else "ngram"
        spec = sorted((r for r in rows if r["method"] == swept), key=lambda r: r["k"])
        hf = sorted((r for r in rows if r["method"] == "hf_assisted"), key=lambda r: r["k"])
        ks = [r["k"] for r in spec]
        if spec:
            ax_speed.plot(ks, [r["speedup_vs_target"] for r in spec], "o-", color=colour,
                          label=f"{name}: {swept}")
            ax_speed.plot(ks, [r["bound_speedup"] for r in spec], "--", color=colour, alpha=0.6,
                          label=f"{name}: bound (Leviathan)")
            ax_speed.plot(ks, [r["bound_speedup_refined"] for r in spec], ":", color=colour, alpha=0.6,
                          label=f"{name}: bound with verify cost")
            ax_acc.plot(ks, [r["acceptance_rate"] for r in spec], "o-", color=colour, label=f"{name}: accepted/drafted")
            ax_acc.plot(ks, [r["alpha"] for r in spec], "s--", color=colour, alpha=0.6, label=f"{name}: alpha")
        if hf:
            ax_speed.plot([r["k"] for r in hf], [r["speedup_vs_target"] for r in hf], "x-.", color=colour,
                          alpha=0.8, label=f"{name}: HF assisted")
        for r in rows:
            if r["method"] == "dynamic":
                ax_speed.axhline(r["speedup_vs_target"], color=colour, linestyle=(0, (5, 2, 1, 2)),
                                 label=f"{name}: dynamic K (mean {r['mean_draft_len']:.1f})")
            if r["method"] == "adaptive":
                ax_speed.axhline(r["speedup_vs_target"], color=colour, linestyle="--", linewidth=2, alpha=0.5,
                                 label=f"{name}: adaptive K, as served (mean {r['mean_draft_len']:.1f})")
            target = next((t for t in rows if t["method"] == "target"), None)
            if r["method"] == "llamacpp" and target and target["tokens_per_s"]:
                # In speedup units: llama.cpp's plain decoding over ours, so every line reads against the same 1.0.
                ax_speed.axhline(r["tokens_per_s"] / target["tokens_per_s"], color=colour, linestyle="-.",
                                 linewidth=1.5, label=f"{name}: llama.cpp {r.get('precision')} plain decoding")
            if r["method"] == "hf_target":
                ax_speed.axhline(r["speedup_vs_target"], color=colour, linestyle=(0, (1, 3)), alpha=0.7,
                                 label=f"{name}: HF target only")
    ax_speed.set(xlabel="K (draft tokens per target step)", ylabel="speedup vs target only",
                 title="Speedup")
    ax_acc.set(xlabel="K (draft tokens per target step)", ylabel="acceptance", title="Acceptance", ylim=(0, 1.02))
    for ax in (ax_speed, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, out, title + memory_bound_note(records))


def memory_bound_note(records: list[dict]) -> str:
    """The memory-bound limit and target-only's share of it per set, for the title ("" when not measured)."""
    targets = [r for r in records if r["method"] == "target" and r.get("fraction_of_memory_bound")]
    if not targets:
        return ""
    limit = targets[0]["tokens_per_s"] / targets[0]["fraction_of_memory_bound"]
    return (f"\nmemory-bound limit {limit:.0f} tok/s; target only reached "
            + ", ".join(f"{r['prompt_set']} {r['fraction_of_memory_bound']:.2f}" for r in targets) + " of it")


def save_figure(fig, out: Path, title: str) -> Path:
    """Title, lay out and write a benchmark figure as PNG, then free it (figures are never shown)."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
