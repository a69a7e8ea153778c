"""`python -m pipeline profile CONFIG --prompts FILE [--draft MODEL ...]`: pick a draft and K before building.

For each candidate draft: load it beside the target with SpeculativeExecutor.from_pretrained (no engines), generate
greedily at K = k_max on the user's prompts, and read the per-position acceptance. Greedy acceptance of the draft
token at position i depends only on the text so far, not on K, so one run at k_max measures it for every K <= k_max.
With the measured cost ratio c and verify cost v_K, the expected speedup of K is

    (1 + sum of acceptance_by_position[:K]) / (K c + v_K)

(tokens a step emits over what a step costs, in target single-token forwards), which needs no i.i.d. assumption.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import PipelineError
from .analytic import best_k_from_survival, expected_tokens_from_survival, speedups_from_survival


@dataclass
class DraftProfile:
    draft: str  # as the user named it
    status: str  # "ok" | "incompatible" | "unavailable"
    reason: str = ""  # why not ok
    acceptance_rate: float = 0.0  # accepted / drafted at K = k_max
    acceptance_by_position: list[float] = field(default_factory=list)  # [k_max]
    cost_ratio_c: float = 0.0
    verify_cost_ratio: list[float] = field(default_factory=list)  # [k_max], K = 1..k_max
    expected_speedup: list[float] = field(default_factory=list)  # [k_max], K = 1..k_max
    best_k: int = 0
    best_speedup: float = 0.0

    def reasoning(self) -> str:
        if self.status != "ok":
            return f"{self.draft}: {self.status}: {self.reason}"
        k = self.best_k
        tokens = expected_tokens_from_survival(self.acceptance_by_position, k)
        by_pos = " ".join(f"{p:.2f}" for p in self.acceptance_by_position)
        return (f"{self.draft}: acceptance by position [{by_pos}], c = {self.cost_ratio_c:.3f}; K={k} maximises "
                f"(1 + accepted by position[:K]) / (K c + verify_K) = {tokens:.2f} / ({k} x {self.cost_ratio_c:.3f} "
                f"+ {self.verify_cost_ratio[k - 1]:.2f}) = {self.best_speedup:.2f}x")


def profile_draft(target_path: Path, draft_name: str, draft_path: Path | None, prompts: list[str], k_max: int,
                  max_new_tokens: int, device: str, dtype: str, cost_repeats: int = 15) -> DraftProfile:
    """Measure one candidate; a draft whose tokenizer differs comes back 'incompatible' instead of raising."""
    from ..executor import RequestError, SpeculativeExecutor
    from .runner import fit_prompt
    from .timing import measure_costs

    if draft_path is None:
        return DraftProfile(draft_name, "unavailable", "not found")
    try:
        executor = SpeculativeExecutor.from_pretrained(target_path, draft_path, max_draft_len=k_max, device=device,
                                                       dtype=dtype)
    except RequestError as exc:  # from_pretrained's tokenizer comparison
        return DraftProfile(draft_name, "incompatible", str(exc))
    except PipelineError as exc:
        return DraftProfile(draft_name, "unavailable", str(exc))
    ids = [fit_prompt(executor, p, max_new_tokens) for p in prompts]
    results = executor.generate(ids, max_new_tokens, temperature=0.0, max_draft_len=k_max)
    stats = results[0].stats
    for result in results[1:]:
        stats = stats.merge(result.stats)
    survival = list(stats.acceptance_by_position)
    if len(survival) < k_max:
        return DraftProfile(draft_name, "unavailable", f"only {len(survival)} draft positions measured; raise "
                                                       f"--max-new-tokens above --k-max {k_max}")
    # The longest prompt plus its generated tokens gives a realistic attention length to time at.
    context = max((p + r.token_ids for p, r in zip(ids, results)), key=len)
    if len(context) < k_max + 1:
        context = (context * (k_max + 1))[:k_max + 1]
    costs = measure_costs(executor.target, executor.draft, context, k_max, repeats=cost_repeats)
    speedups = speedups_from_survival(survival, costs.cost_ratio_c, costs.verify_cost_ratio)
    best_k, best_speedup = best_k_from_survival(survival, costs.cost_ratio_c, costs.verify_cost_ratio)
    return DraftProfile(draft_name, "ok", "", stats.acceptance_rate, survival, costs.cost_ratio_c,
                        costs.verify_cost_ratio, speedups, best_k, best_speedup)


def recommendation(profiles: list[DraftProfile]) -> str:
    usable = [p for p in profiles if p.status == "ok"]
    if not usable:
        return "recommend: nothing to recommend; no candidate draft could be measured (see the reasons above)"
    best = max(usable, key=lambda p: p.best_speedup)
    if best.best_speedup <= 1.0:
        return (f"recommend: serve the target alone; the best candidate ({best.draft}, K={best.best_k}) is "
                f"expected at {best.best_speedup:.2f}x, not faster than target-only decoding")
    return (f"recommend: draft {best.draft} with speculative.max_draft_len: {best.best_k} "
            f"(expected {best.best_speedup:.2f}x over target-only decoding)")


def format_profiles(profiles: list[DraftProfile]) -> str:
    header = ["draft", "status", "accept", "c", "best K", "speedup", "expected speedup K=1.."]
    rows = []
    for p in profiles:
        if p.status == "ok":
            rows.append([p.draft, p.status, f"{p.acceptance_rate:.2f}", f"{p.cost_ratio_c:.3f}", str(p.best_k),
                         f"{p.best_speedup:.2f}x", " ".join(f"{s:.2f}" for s in p.expected_speedup)])
        else:
            rows.append([p.draft, p.status, "-", "-", "-", "-", "-"])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in [header] + rows)


def _resolve_draft(name: str, config) -> Path | None:
    """The config's own draft resolves against the config's folder; --draft values against the working folder."""
    from ..config import ModelSpec
    from ..errors import ModelError
    from ..models import resolve_model

    own = name == config.draft.model
    spec = config.draft if own else ModelSpec(model=name, dtype=config.draft.dtype)
    try:
        return resolve_model(spec, "draft", config.base_dir if own else Path.cwd()).path
    except ModelError:
        return None


def cmd_profile(args) -> int:
    from ..config import MAX_DRAFT_LEN_LIMIT, load_config
    from ..models import resolve_model
    from ..run_cmd import read_prompts

    if not 1 <= args.k_max <= MAX_DRAFT_LEN_LIMIT:
        raise PipelineError(f"--k-max: {args.k_max} must be between 1 and {MAX_DRAFT_LEN_LIMIT}")
    if args.max_new_tokens <= args.k_max:
        raise PipelineError(f"--max-new-tokens: {args.max_new_tokens} must exceed --k-max {args.k_max} so every "
                            f"draft position is measured; raise it")
    if not args.prompts.is_file():
        raise PipelineError(f"--prompts: {args.prompts} not found; pass a file with one prompt per line")
    config = load_config(args.config)
    prompts = read_prompts([], args.prompts)
    device = config.runtime.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    target = resolve_model(config.target, "target", config.base_dir).path
    from tqdm import tqdm

    profiles = []
    for name in tqdm(args.draft or [config.draft.model], desc="profile", unit="draft"):
        profiles.append(profile_draft(target, name, _resolve_draft(name, config), prompts, args.k_max,
                                      args.max_new_tokens, device, config.target.dtype))
    print(format_profiles(profiles))
    for p in profiles:
        print(p.reasoning())
    print(recommendation(profiles))
    if args.json:
        print(json.dumps([asdict(p) for p in profiles], indent=2))
    return 0
