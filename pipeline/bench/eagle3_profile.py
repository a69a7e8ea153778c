"""EAGLE-3 heads in `profile`: acceptance per draft position and the heads' own cost, priced like a draft model.

The heads draft a chain from the text so far, so (as for a draft model) one greedy run at K = k_max measures the
acceptance at every position for every K. The prompts run one at a time (batch 1, as the formula prices a step);
c is the engine's own measurement over that run (one draft position over one verify, running means), and verify_K
the target's forward at K + 1 tokens over a single token's (timing.py); the expected speedup of K is then
(1 + sum of acceptance_by_position[:K]) / (K c + verify_K), as for a draft model.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import PipelineError
from ..methods import Method
from .profile_results import DraftProfile, by_label, chain_figures, timing_context


def profile_eagle3(target_path: Path, heads: Path, prompts: list, labels: list[str], k_max: int,
                   max_new_tokens: int, device: str, dtype: str, cost_repeats: int = 15) -> DraftProfile:
    from ..executor import RequestError, SpeculativeExecutor
    from .runner import fit_prompt
    from .timing import measure_costs

    label = f"eagle3:{heads}"
    try:
        executor = SpeculativeExecutor.from_pretrained(target_path, None, max_draft_len=k_max, device=device,
                                                       dtype=dtype, method=Method.EAGLE3, eagle3=heads)
    except (PipelineError, RequestError, ValueError, OSError) as exc:
        return DraftProfile(label, "unavailable", str(exc), method=Method.EAGLE3)
    ids = [fit_prompt(executor, p, max_new_tokens) for p in prompts]
    results = [executor.generate([x], max_new_tokens, temperature=0.0, max_draft_len=k_max)[0] for x in ids]
    c = executor.engine.costs.value
    verify = measure_costs(executor.target, None, timing_context(ids, results, k_max), k_max,
                           repeats=cost_repeats).verify_cost_ratio
    every = chain_figures([r.stats for r in results], k_max, c, verify)
    per_set = {name: chain_figures([r.stats for r in group], k_max, c, verify)
               for name, group in by_label(labels, results).items()}
    return DraftProfile(label, "ok", "", every.acceptance_rate, every.acceptance_by_position, c, verify,
                        every.expected_speedup, every.best_k, every.best_speedup, method=Method.EAGLE3,
                        dtype=str(executor.target.dtype).removeprefix("torch."), per_set=per_set)
