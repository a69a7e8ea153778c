"""What `bench` leaves behind and prints: results.json (written whole through a temporary file), the table, the cost
terms, the memory-bound limit, the best variant of each method per set (picked by median, with its spread), and the
noisy cells."""

from __future__ import annotations

import json
from pathlib import Path

from ..executor import row_kernels
from .spread import NOISY_SPREAD, best_variant

SWEPT = ("speculative", "ngram")  # the methods whose best K the summary names


def add_memory_bound(records: list[dict], executor):
    """The memory-bound limit (torch runtime only, else None) and each record's share of it and weight bandwidth."""
    from .memory import memory_bound, precision

    bound = memory_bound(executor.target.model, executor.device) if hasattr(executor, "engine") else None
    label = precision(executor.target.model) if bound is not None else None
    for record in records:  # `set` is the name the prompt-file labels use; `prompt_set` stays for older readers
        record.setdefault("set", record["prompt_set"])
        record["fraction_of_memory_bound"] = round(record["tokens_per_s"] / bound.tok_s, 3) if bound else None
        if bound is not None:  # each target forward reads the target's weights once, whatever it verifies
            record.update(precision=label, weight_bytes=bound.weight_bytes,
                          weight_gbs=round(bound.achieved_gbs(record["tokens_per_s"], record["mean_accepted_len"]), 2))
    return bound


def runner_info(executor) -> dict | None:
    """Per role, the model runner, (lean decoder) the matrix product it measured per forward width (and whether
    the rows kernel loaded) and the attention kernel per query width; None for the TensorRT-LLM executor."""
    if not hasattr(executor, "engine"):
        return None
    runners = (("target", executor.target), ("draft", getattr(executor, "draft", None)))
    return {role: {"runner": r.runner, "why_not_lean": r.why_modules,
                   "kernels": r.kernels.to_dict() if r.kernels is not None else None,
                   "rows_kernel": row_kernels.state(),
                   "attention": r.cache.attention.to_dict(), "compiled": _compiled(r)}
            for role, r in runners if r is not None}


def _compiled(runner) -> dict | None:
    """The lean decoder's compiled buckets, what each measured and which bucket runs each width, the warm-up time
    and how many graphs it compiled (the rest were loaded), or None when it runs eager (runtime.torch_compile)."""
    compiled = getattr(runner, "compiled", None)
    if compiled is None:
        return None
    return {"buckets": compiled.sizes, "bucket_ms": {str(k): v for k, v in compiled.bucket_ms.items()},
            "route": {str(k): v for k, v in compiled.route.items()}, "warm_up_s": round(compiled.warm_up_s, 1),
            "compiled_graphs": compiled.built, "eager_calls": compiled.eager_calls}


def runner_lines(info: dict | None) -> list[str]:
    """One printed line per role: its runner, the product per width (``linear`` / ``w_xt`` / ``rows``) and the attention
    kernel per query width."""
    lines = []
    for role, facts in (info or {}).items():
        kernels = (facts["kernels"] or {}).get("by_width") or {}
        products = ", ".join(f"{width}: {kind}" for width, kind in kernels.items()) or "F.linear at every width"
        rows_kernel = facts.get("rows_kernel")
        if rows_kernel and not rows_kernel.startswith(("loaded", "not tried")):
            products += f" (no rows kernel: {rows_kernel})"
        compiled = facts.get("compiled")
        if compiled:
            products = f"compiled per width bucket {compiled['buckets']} (warm-up {compiled['warm_up_s']} s)"
            rerouted = {w: b for w, b in compiled.get("route", {}).items() if int(w) != b}
            if rerouted:  # a bucket slower than a wider one
                products += "; run wider: " + ", ".join(f"{w} as {b}" for w, b in rerouted.items())
        attention = ", ".join(f"{w}: {kind}" for w, kind in ((facts.get("attention") or {}).get("by_width") or {})
                              .items()) or "SDPA at every width"
        lines.append(f"{role} runner: {facts['runner']}" + (f" ({facts['why_not_lean']})" if facts["why_not_lean"]
                                                           else f"; matrix product by forward width: {products}")
                     + f"; attention by query width: {attention}")
    return lines


def best_by_set(records: list[dict]) -> dict[str, dict]:
    """results.json's "best": per set, the best variant of each swept method (median speedup) and the variants
    within its noise."""
    best: dict[str, dict] = {}
    for name in dict.fromkeys(r["prompt_set"] for r in records):
        for method in ("speculative", "ngram", "hf_assisted"):
            pick = best_variant([r for r in records if r["prompt_set"] == name and r["method"] == method])
            if pick is None:
                continue
            r = pick.record
            best.setdefault(name, {})[method] = {
                "k": r["k"], "speedup_vs_target": r["speedup_vs_target"], "speedup_min": r.get("speedup_min"),
                "speedup_max": r.get("speedup_max"), "within_noise_of": [x["k"] for x in pick.rivals],
                "repeats": pick.repeats,
                "noisy": r.get("noisy", False)}
    return best


def write_results(out_dir: Path, results: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    path = out_dir / "results.json"
    tmp.replace(path)
    return path


def print_report(records: list[dict], costs, bound, k_max: int) -> None:
    from .records import format_table

    print(format_table(records))
    print(f"cost terms: c = {costs.cost_ratio_c:.3f} (draft {costs.draft_ms:.2f} ms / target {costs.target_ms:.2f} "
          f"ms per token); verify cost K=1..{k_max}: " + " ".join(f"{v:.2f}" for v in costs.verify_cost_ratio))
    if bound is not None:
        print(f"memory-bound limit: {bound.tok_s:.1f} tok/s (target weights {bound.weight_bytes / 1e6:.0f} MB "
              f"{records[0].get('precision')} read at a measured {bound.bandwidth_gbs:.1f} GB/s); target-only reached "
              + ", ".join(f"{r['set']} {r['fraction_of_memory_bound']:.2f}" for r in records
                          if r["method"] == "target"))
    for line in summary_lines(records) + drift_lines(records) + noisy_lines(records):
        print(line)


def summary_lines(records: list[dict]) -> list[str]:
    """One line per prompt set: the best speculative K (median, with its spread and its rivals within noise)
    against its bound, adaptive K against it, and the best HF assisted K."""
    lines = []
    for name in dict.fromkeys(r["prompt_set"] for r in records):
        rows = [r for r in records if r["prompt_set"] == name and r["speedup_vs_target"] is not None]
        spec = best_variant([r for r in rows if r["method"] in SWEPT])
        if spec is not None:
            best = spec.record
            lines.append(f"{name}: best {best['method']} {spec.describe()}; bound {best['bound_speedup']:.2f}x, with "
                         f"verify cost {best['bound_speedup_refined']:.2f}x, efficiency {best['efficiency']:.2f}; "
                         f"alpha {best['alpha']:.2f}, {best['mean_accepted_len']:.2f} tokens/step")
        for r in (r for r in rows if r["method"] == "adaptive"):
            lines.append(f"{name}: adaptive K {r['speedup_vs_target']:.2f}x target-only"
                         + (f", {r['speedup_vs_target'] / spec.record['speedup_vs_target']:.2f} of the best fixed K"
                            if spec is not None else ""))
        hf = best_variant([r for r in rows if r["method"] == "hf_assisted"])
        if hf is not None:
            lines.append(f"{name}: best HF assisted {hf.describe()} vs our target-only"
                         + (f" ({hf.record['speedup_vs_hf_target']:.2f}x vs HF target-only)"
                            if hf.record.get("speedup_vs_hf_target") is not None else ""))
    return lines


def drift_lines(records: list[dict]) -> list[str]:
    """A line when target-only's own rate moved between repeats by more than a noisy cell may ([] otherwise)."""
    moved = [r for r in records if r["method"] == "target" and (r.get("rate_spread") or 0) > NOISY_SPREAD]
    if not moved:
        return []
    return [f"the machine's speed moved between repeats: target-only's rate spread "
            + ", ".join(f"{r['prompt_set']} {r['rate_spread']:.0%}" for r in moved)
            + "; each speedup pairs a repeat with target-only's in the same repeat, which cancels a slow drift"]


MAX_NOISY_LISTED = 8  # past this many the machine's load, not a cell, is the story


def noisy_lines(records: list[dict]) -> list[str]:
    """The noisy cells, each with its reason, and what to do about them ([] when there are none)."""
    noisy = [r for r in records if r.get("noisy")]
    if not noisy:
        return []
    cells = "; ".join(f"{r['prompt_set']} {r['method']} K={r['k']} ({r['noise']})" for r in noisy[:MAX_NOISY_LISTED])
    more = f"; and {len(noisy) - MAX_NOISY_LISTED} more" if len(noisy) > MAX_NOISY_LISTED else ""
    timed = [r for r in records if r.get("speedup_vs_target") is not None]
    return [f"noisy cells ({len(noisy)} of {len(timed)}): {cells}{more}. Their speedups are less certain than the "
            f"others': rerun with more --repeats, or on an idle machine"]
