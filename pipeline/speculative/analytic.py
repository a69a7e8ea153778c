"""The analytic model of speculative decoding speed (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"), as pure functions of measured terms.

Terms, all measured on the user's own pair and machine:
  alpha        per-token acceptance rate: the chance the target keeps a draft token, given it kept the ones before.
  k            draft tokens proposed per target step (K).
  c            cost ratio: one draft forward of one token over one target forward of one token (KV cache warm).
  verify_cost  one target forward over K+1 tokens over one target forward of one token (1.0 in the paper's model;
               on a CPU it grows with K because the forward is not free to widen).

A target step emits the accepted draft prefix plus one token from the target, so with i.i.d. acceptance it emits
(1 - alpha^(K+1)) / (1 - alpha) tokens on average, and costs K draft forwards plus one verify forward.
"""

from __future__ import annotations

from collections.abc import Sequence


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha: {alpha} must be a probability in [0, 1]")


def expected_tokens_per_step(alpha: float, k: float) -> float:
    """Mean tokens a target step emits with i.i.d. acceptance: (1 - alpha^(K+1)) / (1 - alpha)."""
    _check_alpha(alpha)
    if k < 0:
        raise ValueError(f"k: {k} must be >= 0")
    if alpha == 1.0:
        return k + 1.0  # the limit of the geometric sum
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_tokens_from_survival(survival: Sequence[float], k: int) -> float:
    """Mean tokens per step from measured per-position acceptance, with no i.i.d. assumption.

    ``survival[i]`` is the share of steps whose draft token at position i was accepted (so all before it were),
    which is what GenerationStats.acceptance_by_position reports. A step emits 1 + (accepted prefix length).
    """
    if k > len(survival):
        raise ValueError(f"k: {k} exceeds the {len(survival)} measured positions; profile with a larger --k-max")
    return 1.0 + float(sum(survival[:k]))


def step_cost(k: float, c: float, verify_cost: float = 1.0) -> float:
    """Cost of one target step in units of one target single-token forward: K draft forwards + one verify."""
    if c < 0 or verify_cost <= 0:
        raise ValueError(f"c: {c} must be >= 0 and verify_cost: {verify_cost} > 0 (they are measured time ratios)")
    return k * c + verify_cost


def speedup_bound(alpha: float, k: float, c: float, verify_cost: float = 1.0) -> float:
    """Leviathan et al.'s expected walltime improvement (1 - a^(K+1)) / ((1 - a)(K c + 1)).

    With ``verify_cost`` != 1 the "+1" (a verify forward costs one target step) becomes the measured verify cost:
    the refined bound. Neither counts the loop's own overhead (sampling, accept rule, cache rollback), which is why
    measured speedups sit below them.
    """
    return expected_tokens_per_step(alpha, k) / step_cost(k, c, verify_cost)


def alpha_from_steps(steps: Sequence[tuple[int, int]]) -> float:
    """Per-token acceptance rate from (drafted, accepted) per target step: the maximum-likelihood estimate of a
    geometric acceptance process, accepted / (accepted + rejections).

    A step that drafted k and accepted m < k saw m acceptances and one rejection; a step that accepted all k saw
    k acceptances and no rejection. Steps that drafted nothing carry no information.
    """
    accepted = sum(m for k, m in steps if k > 0)
    rejections = sum(1 for k, m in steps if k > 0 and m < k)
    if accepted + rejections == 0:
        return 0.0
    return accepted / (accepted + rejections)


def speedups_from_survival(survival: Sequence[float], c: float, verify_costs: Sequence[float] | None = None
                           ) -> list[float]:
    """[len(survival)] expected speedup of K = 1..len(survival): tokens a step emits over what it costs.

    ``survival`` is the measured per-position acceptance (see expected_tokens_from_survival);
    ``verify_costs[k - 1]`` is the measured verify cost at K=k, None uses the paper's 1.0 for every K.
    """
    if not survival:
        raise ValueError("survival: no measured positions; profile with --k-max >= 1")
    if verify_costs is not None and len(verify_costs) < len(survival):
        raise ValueError(f"verify_costs: {len(verify_costs)} values for {len(survival)} positions; measure one "
                         f"per K")
    return [expected_tokens_from_survival(survival, k) /
            step_cost(k, c, verify_costs[k - 1] if verify_costs is not None else 1.0)
            for k in range(1, len(survival) + 1)]


def best_k_from_survival(survival: Sequence[float], c: float, verify_costs: Sequence[float] | None = None
                         ) -> tuple[int, float]:
    """The K with the highest expected speedup (speedups_from_survival), and that speedup; ties (within float
    rounding) go to the smaller K, which costs less draft work for the same gain."""
    best = (0, 0.0)
    for k, value in enumerate(speedups_from_survival(survival, c, verify_costs), 1):
        if value > best[1] + 1e-12:
            best = (k, value)
    return best
