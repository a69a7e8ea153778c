"""What `profile` measured per candidate, over all prompts and per set label, and what it recommends from that.

A candidate's figures per set come from the same generations as its overall ones, grouped by each prompt's set
label (pipeline/prompt_files.py), and are costed with the candidate's one measured c and verify cost: a set label
changes which text is drafted for, not what a forward costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..methods import Method
from ..speculative.analytic import best_k_from_survival, expected_tokens_from_survival, speedups_from_survival

MEDUSA_ROUNDS = 2  # interleaved rounds of target-only and Medusa decoding; each prompt keeps its best


@dataclass
class SetFigures:
    """A candidate's figures on the prompts of one set label."""

    prompts: int
    acceptance_rate: float = 0.0
    acceptance_by_position: list[float] = field(default_factory=list)  # [k_max]; medusa: per tree depth
    expected_speedup: list[float] = field(default_factory=list)  # [k_max], K = 1..k_max (chains only)
    best_k: int = 0
    best_speedup: float = 0.0
    tokens_per_step: float = 0.0


@dataclass
class DraftProfile:
    draft: str  # as the user named it ("ngram" for lookups alone)
    status: str  # "ok" | "incompatible" | "unavailable"
    reason: str = ""  # why not ok
    acceptance_rate: float = 0.0  # accepted / drafted at K = k_max
    acceptance_by_position: list[float] = field(default_factory=list)  # [k_max]
    cost_ratio_c: float = 0.0
    verify_cost_ratio: list[float] = field(default_factory=list)  # [k_max], K = 1..k_max
    expected_speedup: list[float] = field(default_factory=list)  # [k_max], K = 1..k_max
    best_k: int = 0
    best_speedup: float = 0.0
    method: Method = Method.DRAFT_MODEL  # the speculative.method this candidate is
    draft_step_share: float = 1.0  # ngram+draft: share of speculative steps the draft model proposed
    dtype: str = ""  # the dtype the draft ran in (its cost ratio c depends on it); "" for lookups
    tokens_per_step: float = 0.0  # medusa: tokens emitted per target step (its tree steps and its first, plain one)
    choices: list | str | None = None  # medusa: the tree measured
    per_set: dict[str, SetFigures] = field(default_factory=dict)  # set label -> the same figures on its prompts

    def for_set(self, name: str) -> DraftProfile:
        """This candidate as measured on one set's prompts (unavailable when it has none there)."""
        figures = self.per_set.get(name)
        if self.status != "ok" or figures is None:
            return replace(self, status=self.status if self.status != "ok" else "unavailable", per_set={})
        return replace(self, acceptance_rate=figures.acceptance_rate,
                       acceptance_by_position=figures.acceptance_by_position,
                       expected_speedup=figures.expected_speedup, best_k=figures.best_k,
                       best_speedup=figures.best_speedup, tokens_per_step=figures.tokens_per_step, per_set={})

    def reasoning(self) -> str:
        if self.status != "ok":
            return f"{self.draft}: {self.status}: {self.reason}"
        k = self.best_k
        if self.method == Method.MEDUSA:
            by_depth = " ".join(f"{p:.2f}" for p in self.acceptance_by_position)
            return (f"{self.draft}: acceptance by tree depth [{by_depth}], {self.tokens_per_step:.2f} tokens per "
                    f"target step; measured {self.best_speedup:.2f}x target-only on these prompts (wall clock, "
                    f"batch 1, best of {MEDUSA_ROUNDS} interleaved rounds)")
        if self.method == Method.NGRAM_DRAFT:
            return (f"{self.draft}: at K={k} the draft proposed in {self.draft_step_share:.0%} of speculative steps, "
                    f"lookups in the rest; tokens per step over cost per step = {self.best_speedup:.2f}x")
        tokens = expected_tokens_from_survival(self.acceptance_by_position, k)
        by_pos = " ".join(f"{p:.2f}" for p in self.acceptance_by_position)
        return (f"{self.draft}: acceptance by position [{by_pos}], c = {self.cost_ratio_c:.3f}; K={k} maximises "
                f"(1 + accepted by position[:K]) / (K c + verify_K) = {tokens:.2f} / ({k} x {self.cost_ratio_c:.3f} "
                f"+ {self.verify_cost_ratio[k - 1]:.2f}) = {self.best_speedup:.2f}x")


def timing_context(ids, results, k_max: int) -> list[int]:
    """The longest prompt plus its generated tokens: a realistic attention length to time the verify at."""
    context = max((p + r.token_ids for p, r in zip(ids, results)), key=len)
    return context if len(context) >= k_max + 1 else (context * (k_max + 1))[:k_max + 1]


def merged(stats: list):
    """GenerationStats of several requests added together."""
    total = stats[0]
    for one in stats[1:]:
        total = total.merge(one)
    return total


def by_label(labels: list[str], values: list) -> dict[str, list]:
    """``values`` grouped by the set label of the prompt each belongs to, sets in order of first appearance."""
    groups: dict[str, list] = {}
    for label, value in zip(labels, values):
        groups.setdefault(label, []).append(value)
    return groups


def chain_figures(stats: list, k_max: int, c: float, verify: list[float], per_step: bool = False) -> SetFigures:
    """A chain proposer's figures on some requests: acceptance by position (per proposal, or per target step for
    lookups, ``per_step``, where a step without a match weighs in), padded with 0 where no step reached a
    position, and the expected speedup of each K with the measured ``c`` and ``verify``."""
    total = merged(stats)
    if per_step:
        accepted = total.accepted_at + [0] * (k_max - len(total.accepted_at))
        survival = [a / max(total.target_steps, 1) for a in accepted[:k_max]]
    else:
        survival = (list(total.acceptance_by_position) + [0.0] * k_max)[:k_max]
    speedups = speedups_from_survival(survival, c, verify)
    best_k, best_speedup = best_k_from_survival(survival, c, verify)
    return SetFigures(len(stats), total.acceptance_rate, survival, speedups, best_k, best_speedup,
                      total.mean_accepted_len)


def recommendation(profiles: list[DraftProfile], scope: str = "") -> str:
    """One line: the candidate (method, draft, K or tree) with the highest speedup, or the target alone;
    ``scope`` names what it was measured on (" for set code")."""
    usable = [p for p in profiles if p.status == "ok"]
    lead = f"recommend{scope}:"
    if not usable:
        return f"{lead} nothing to recommend; no candidate draft could be measured (see the reasons above)"
    best = max(usable, key=lambda p: p.best_speedup)
    if best.best_speedup <= 1.0:
        how = "measured" if best.method == Method.MEDUSA else "expected"
        return (f"{lead} serve the target alone; the best candidate ({best.draft}, K={best.best_k}) is "
                f"{how} at {best.best_speedup:.2f}x, not faster than target-only decoding")
    if best.method == Method.MEDUSA:
        return (f"{lead} speculative.method: medusa with speculative.medusa.choices: {best.choices} (measured "
                f"{best.best_speedup:.2f}x over target-only decoding)")
    gain = f"(expected {best.best_speedup:.2f}x over target-only decoding)"
    if best.method in (Method.NGRAM, Method.SUFFIX):
        return (f"{lead} speculative.method: {Method(best.method).value} with speculative.max_draft_len: "
                f"{best.best_k}, no draft model {gain}")
    if best.method == Method.NGRAM_DRAFT:
        return (f"{lead} speculative.method: ngram+draft with draft {best.draft.removeprefix('ngram+')} and "
                f"speculative.max_draft_len: {best.best_k} {gain}")
    if best.method == Method.EAGLE3:
        return (f"{lead} speculative.method: eagle3 with eagle3: {{model: {best.draft.removeprefix('eagle3:')}}} "
                f"and speculative.max_draft_len: {best.best_k} {gain}")
    return (f"{lead} speculative.method: draft_model with draft {best.draft} and speculative.max_draft_len: "
            f"{best.best_k} {gain}")


def set_names(profiles: list[DraftProfile]) -> list[str]:
    """Every set label any candidate was measured on, in order of first appearance."""
    return list(dict.fromkeys(name for p in profiles for name in p.per_set))


def per_set_recommendations(profiles: list[DraftProfile]) -> list[str]:
    """One recommendation per set label ([] when the prompts carry one label: the overall one says it all)."""
    names = set_names(profiles)
    if len(names) < 2:
        return []
    return [recommendation([p.for_set(name) for p in profiles],
                           f" for set {name} ({_prompts_in(profiles, name)} prompts)") for name in names]


def _prompts_in(profiles: list[DraftProfile], name: str) -> int:
    return max(p.per_set[name].prompts for p in profiles if name in p.per_set)


def format_profiles(profiles: list[DraftProfile]) -> str:
    header = ["draft", "status", "dtype", "accept", "c", "best K", "speedup", "expected speedup K=1.."]
    rows = []
    for p in profiles:
        if p.status == "ok" and p.method == Method.MEDUSA:
            rows.append([p.draft, p.status, p.dtype, f"{p.acceptance_rate:.2f}", "-", f"{p.best_k} (depth)",
                         f"{p.best_speedup:.2f}x", f"measured; {p.tokens_per_step:.2f} tokens/step"])
        elif p.status == "ok":
            rows.append([p.draft, p.status, p.dtype or "-", f"{p.acceptance_rate:.2f}", f"{p.cost_ratio_c:.3f}",
                         str(p.best_k), f"{p.best_speedup:.2f}x", " ".join(f"{s:.2f}" for s in p.expected_speedup)])
        else:
            rows.append([p.draft, p.status, "-", "-", "-", "-", "-", "-"])
    return _aligned(header, rows)


def format_per_set(profiles: list[DraftProfile]) -> str:
    """Each candidate's best K and speedup per set label, one column per set ("" with fewer than two sets)."""
    names = set_names(profiles)
    if len(names) < 2:
        return ""
    rows = []
    for p in (p for p in profiles if p.status == "ok"):
        cells = []
        for name in names:
            view = p.for_set(name)
            cells.append(f"K={view.best_k} {view.best_speedup:.2f}x" if view.status == "ok" else "-")
        rows.append([p.draft, *cells])
    return _aligned(["best K per set", *names], rows)


def _aligned(header: list[str], rows: list[list[str]]) -> str:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in [header] + rows)
