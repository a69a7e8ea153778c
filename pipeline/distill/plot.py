"""The training curve of a distilled draft: held-out acceptance and greedy agreement against training tokens."""

from __future__ import annotations

from pathlib import Path

PLOT_FILE = "training.png"  # beside what train-draft writes


def plot_history(history: dict, out: Path, title: str) -> Path:
    """Write ``out`` (PNG): what the draft learnt as training went on, from the history train_draft returns."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    evals = history["evals"]
    per_step = history.get("tokens_per_step") or 1
    tokens = [e["step"] * per_step for e in evals]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(tokens, [e["acceptance"] for e in evals], "o-", label="acceptance, sum min(target, draft)")
    ax.plot(tokens, [e["agreement"] for e in evals], "s--", label="greedy agreement (top-1 equal)")
    for h in range(1, len(evals[0].get("by_head", []))):  # Medusa heads after the first, further ahead
        ax.plot(tokens, [e["by_head"][h]["acceptance"] for e in evals], "o-", alpha=0.6,
                label=f"head {h} acceptance ({h + 2} tokens ahead)")
    for j in range(1, len(evals[0].get("by_position", []))):  # EAGLE-3's later draft steps, on its own outputs
        ax.plot(tokens, [e["by_position"][j]["acceptance"] for e in evals], "o-", alpha=0.6,
                label=f"draft position {j + 1} acceptance")
    if any(e.get("coverage", 1.0) < 1.0 for e in evals):
        ax.plot(tokens, [e["coverage"] for e in evals], ":", color="grey",
                label="target probability inside the draft's vocabulary (ceiling)")
    ax.set_xlabel("training tokens" if history.get("tokens_per_step") else "training steps")
    ax.set_ylabel("held-out share")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
