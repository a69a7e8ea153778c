"""Turn timed samples into benchmark records (one per method and K) and print them as a table.

Record fields (results.json):
  method               target | speculative | dynamic | ngram | ngram+draft | adaptive | hf_target | hf_assisted |
                       hf_lookup | llamacpp (llama.cpp's llama-bench on a GGUF, bench --llamacpp: llamacpp.py)
  k                    draft tokens per step (0 = no draft; "auto" for dynamic K, "policy" for adaptive)
  set, prompt_set      the prompt set: a built-in one or a `set` label of a --prompts file (the same value)
  tokens_per_s         median over repeats of (tokens emitted / wall seconds) over all prompts
  decode_tokens_per_s  the same after each prompt's first token: (tokens - 1) / (wall - ttft) summed over the
                       prompts, median over repeats; no prefill in it, what llama-bench's decode test measures
                       (a llamacpp record: its tokens_per_s)
  tokens_per_s_min/max, tokens_per_s_by_repeat   the same rate per repeat: its spread, and each value
  speedup_vs_target    tokens_per_s / tokens_per_s of target-only decoding on our runtime (same prompts)
  speedup_by_repeat, speedup_min/max, spread   each repeat's rate over target-only's in the same repeat, their
                       range (holding speedup_vs_target) and its width over speedup_vs_target (spread.py)
  rate_spread          (fastest - slowest repeat's tokens_per_s) / tokens_per_s: on target-only, the machine's drift
  noisy, noise         whether the cell is noisy (its spread, or off its K trend) and why (spread.py)
  acceptance_rate      accepted / drafted draft tokens (GenerationStats.acceptance_rate)
  alpha                per-token acceptance rate, geometric maximum-likelihood (analytic.alpha_from_steps)
  mean_accepted_len    tokens emitted per target step (1.0 = plain decoding)
  mean_draft_len       draft tokens per target step (K, except near max_new_tokens and for dynamic K)
  cost_ratio_c         draft/target single-token forward time (measured once per run)
  verify_cost_ratio    target forward over K+1 tokens / over 1 token (1.0 at K=0)
  bound_speedup        Leviathan et al.: (1 - alpha^(K+1)) / ((1 - alpha)(K c + 1))
  bound_speedup_refined  the same with the "+1" replaced by the measured verify cost ratio
  predicted_speedup    measured tokens/step / (K c + verify cost): the bound with acceptance as measured
  efficiency           speedup_vs_target / bound_speedup (and efficiency_refined against the refined bound)
  itl_ms_p50/p90, ttft_ms   latency, as defined in measure.py
  fraction_of_memory_bound  tokens_per_s / the memory-bound limit of one-token steps (memory.py); added by the
                       bench command on the torch runtime, null elsewhere
  precision, weight_bytes, weight_gbs  the target's weight type (f32, bf16, int8/bf16; a llamacpp record: the
                       GGUF's), its weight bytes, and the weight bandwidth achieved: bytes x target forwards per
                       second (tokens_per_s / mean_accepted_len; llamacpp: tokens_per_s) / 1e9. Compare it with
                       cost_terms.memory_bandwidth_gbs, the machine's measured read bandwidth. Null on trtllm.
                       (The llamacpp records' speculation and latency fields are null.)
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from ..speculative.analytic import alpha_from_steps, speedup_bound, step_cost
from .measure import Sample
from .spread import add_spread, flag_noisy
from .timing import CostTerms, percentile


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(float(value), digits)


def _acceptance_by_position(steps: Sequence[tuple[int, int]]) -> list[float]:
    """Of the steps that drafted position d (Medusa: a tree at least d deep), the share that kept it."""
    shares = []
    for d in range(max((drafted for drafted, _ in steps), default=0)):
        reached = [accepted for drafted, accepted in steps if drafted > d]
        shares.append(_round(sum(accepted > d for accepted in reached) / len(reached)))
    return shares


def make_record(method: str, k: int | str, prompt_set: str, repeats: Sequence[Sequence[Sample]],
                costs: CostTerms, c: float | None = None) -> dict:
    """``repeats[r][p]`` is prompt p of repeat r. Greedy decoding makes every repeat emit the same tokens, so
    acceptance comes from the first repeat and only the timings are pooled. ``c``: the method's own cost ratio
    where the run's cost terms do not describe it (EAGLE-3 heads)."""
    throughputs = [sum(s.tokens for s in rep) / max(sum(s.seconds for s in rep), 1e-12) for rep in repeats]
    decoding = [sum(s.tokens - 1 for s in rep) / max(sum(s.seconds - s.ttft_s for s in rep), 1e-12)
                for rep in repeats]
    itl = [x for rep in repeats for s in rep for x in s.itl_s]
    ttft = [s.ttft_s for rep in repeats for s in rep]
    steps = [step for s in repeats[0] for step in s.steps]
    drafted = sum(d for d, _ in steps)
    accepted = sum(a for _, a in steps)
    tokens = sum(s.tokens for s in repeats[0])
    k_mean = drafted / len(steps) if steps else 0.0
    alpha = alpha_from_steps(steps)
    # Lookups and suffix trees run no model: their cost ratio is 0. (The hybrid keeps the draft's c: an upper bound on its cost.)
    if c is None:
        c = 0.0 if method in ("ngram", "suffix", "hf_lookup") else costs.cost_ratio_c
    if method in ("target", "hf_target"):
        verify, bound, refined = 1.0, 1.0, 1.0
    elif method == "medusa":  # a tree step: the chain model's bounds and verify cost do not describe it
        verify = bound = refined = c = None
    else:
        # Dynamic K drafts a varying number per step: evaluate the model at the mean, with the verify cost of the
        # nearest measured K.
        k_model = float(k) if isinstance(k, int) else k_mean
        verify = costs.verify_cost(min(max(round(k_model), 1), len(costs.verify_ms)))
        bound = speedup_bound(alpha, k_model, c)
        refined = speedup_bound(alpha, k_model, c, verify)
    predicted = (tokens / len(steps)) / step_cost(k_mean, c, verify) if steps and verify is not None else None
    return {
        "method": method, "k": k, "set": prompt_set, "prompt_set": prompt_set,
        "tokens_per_s": _round(statistics.median(throughputs), 2),
        "tokens_per_s_min": _round(min(throughputs), 2), "tokens_per_s_max": _round(max(throughputs), 2),
        "tokens_per_s_by_repeat": [_round(x, 2) for x in throughputs],
        "decode_tokens_per_s": _round(statistics.median(decoding), 2),
        "speedup_vs_target": None,  # filled by finish_records once target-only is known
        "acceptance_rate": _round(accepted / drafted if drafted else 0.0),
        "alpha": _round(alpha),
        "mean_accepted_len": _round(tokens / len(steps) if steps else 0.0),
        "mean_draft_len": _round(k_mean),
        "acceptance_by_position": _acceptance_by_position(steps),
        "cost_ratio_c": _round(c), "verify_cost_ratio": _round(verify),
        "bound_speedup": _round(bound), "bound_speedup_refined": _round(refined),
        "predicted_speedup": _round(predicted),
        "efficiency": None, "efficiency_refined": None,
        "itl_ms_p50": _round(percentile(itl, 50) * 1000, 3) if itl else None,
        "itl_ms_p90": _round(percentile(itl, 90) * 1000, 3) if itl else None,
        "ttft_ms": _round(statistics.median(ttft) * 1000, 3) if ttft else None,
        "tokens": tokens, "target_steps": len(steps), "prompts": len(repeats[0]), "repeats": len(repeats),
    }


def finish_records(records: list[dict]) -> list[dict]:
    """Fill speedup_vs_target, its range over the repeats and efficiency, per prompt set, against our runtime's
    target-only record; then flag the noisy cells (spread.py)."""
    targets = {r["prompt_set"]: r for r in records if r["method"] == "target"}
    hf_baselines = {r["prompt_set"]: r["tokens_per_s"] for r in records if r["method"] == "hf_target"}
    for record in records:
        target = targets.get(record["prompt_set"])
        base = target["tokens_per_s"] if target else None
        if not base:
            continue
        speedup = record["tokens_per_s"] / base
        record["speedup_vs_target"] = _round(speedup)
        add_spread(record, target)
        record["efficiency"] = _round(speedup / record["bound_speedup"]) if record["bound_speedup"] else None
        record["efficiency_refined"] = (_round(speedup / record["bound_speedup_refined"])
                                        if record["bound_speedup_refined"] else None)
        hf_base = hf_baselines.get(record["prompt_set"])
        if record["method"].startswith("hf_") and hf_base:
            record["speedup_vs_hf_target"] = _round(record["tokens_per_s"] / hf_base)
    return flag_noisy(records)


# "weights" tells the rows of different weight types apart (ours: the target's; llama.cpp's: one per GGUF).
_COLUMNS = [("prompt_set", "set", "{}"), ("method", "method", "{}"), ("k", "K", "{}"), ("precision", "weights", "{}"),
            ("tokens_per_s", "tok/s", "{:.1f}"), ("decode_tokens_per_s", "decode tok/s", "{:.1f}"),
            ("weight_gbs", "weight GB/s", "{:.1f}"),
            ("speedup_vs_target", "speedup", "{:.2f}x"),
            ("speedup_min", "min-max", lambda r: f"{r['speedup_min']:.2f}-{r['speedup_max']:.2f}"),
            ("noisy", "noisy", lambda r: "noisy" if r["noisy"] else ""),
            ("acceptance_rate", "accept", "{:.2f}"), ("alpha", "alpha", "{:.2f}"),
            ("mean_accepted_len", "tok/step", "{:.2f}"), ("cost_ratio_c", "c", "{:.2f}"),
            ("verify_cost_ratio", "verify", "{:.2f}"), ("bound_speedup", "bound", "{:.2f}x"),
            ("bound_speedup_refined", "bound+v", "{:.2f}x"), ("efficiency", "eff", "{:.2f}"),
            ("itl_ms_p50", "itl p50 ms", "{:.2f}"), ("itl_ms_p90", "itl p90 ms", "{:.2f}"),
            ("ttft_ms", "ttft ms", "{:.1f}"), ("fraction_of_memory_bound", "of mem bound", "{:.2f}")]


def _cell(record: dict, key: str, fmt) -> str:
    if record.get(key) is None:
        return "-"
    return fmt(record) if callable(fmt) else fmt.format(record[key])


def format_table(records: list[dict]) -> str:
    """Records as an aligned text table."""
    header = [title for _, title, _ in _COLUMNS]
    rows = [[_cell(r, key, fmt) for key, _, fmt in _COLUMNS] for r in records]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    fmt_row = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt_row(header)] + [fmt_row(row) for row in rows])
