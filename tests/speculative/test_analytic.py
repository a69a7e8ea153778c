"""The analytic speedup model (pipeline/speculative/analytic.py): pure functions, exact values."""

from __future__ import annotations

import pytest

from pipeline.speculative.analytic import (alpha_from_steps, best_k_from_survival, expected_tokens_from_survival,
                                           expected_tokens_per_step, speedup_bound, speedups_from_survival, step_cost)


def test_expected_tokens_per_step_is_the_geometric_sum():
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert expected_tokens_per_step(0.8, 1) == pytest.approx(1.8)
    assert expected_tokens_per_step(0.0, 5) == pytest.approx(1.0)  # only the target's own token
    assert expected_tokens_per_step(1.0, 3) == pytest.approx(4.0)  # the limit, no division by zero
    assert expected_tokens_per_step(0.6, 0) == pytest.approx(1.0)


def test_speedup_bound_matches_leviathan_and_the_refined_form():
    # (1 - 0.5^3) / ((1 - 0.5)(2 * 0.25 + 1)) = 1.75 / 1.5
    assert speedup_bound(0.5, 2, 0.25) == pytest.approx(7 / 6)
    assert speedup_bound(0.5, 2, 0.25, verify_cost=1.5) == pytest.approx(1.75 / 2.0)
    assert step_cost(3, 0.2, 1.4) == pytest.approx(2.0)
    assert speedup_bound(0.0, 4, 0.0) == pytest.approx(1.0)  # free draft that is always wrong: no gain, no loss


def test_best_k_exact():
    # i.i.d. acceptance 0.8 (survival 0.8^i) reproduces Leviathan's bound: with c 0.1 the bounds are
    # 1.636 2.033 2.271 2.401 2.460 2.470 2.448 ... -> K = 6
    survival = [0.8 ** i for i in range(1, 9)]
    assert speedups_from_survival(survival, 0.1) == pytest.approx([speedup_bound(0.8, k, 0.1) for k in range(1, 9)])
    k, value = best_k_from_survival(survival, 0.1)
    assert k == 6
    assert value == pytest.approx((1 - 0.8 ** 7) / 0.2 / 1.6)
    # a costly verify of wide forwards pulls K down: verify cost 1 + 0.3 K
    k, value = best_k_from_survival(survival, 0.1, verify_costs=[1 + 0.3 * k for k in range(1, 9)])
    assert k == 2
    assert value == pytest.approx(2.44 / (0.2 + 1.6))
    # a useless draft: K = 1 loses least, and the bound says it loses
    k, value = best_k_from_survival([0.0] * 4, 0.5)
    assert (k, value) == (1, pytest.approx(1 / 1.5))


def test_survival_form_needs_no_iid_assumption():
    survival = [0.8, 0.5, 0.2]
    assert expected_tokens_from_survival(survival, 0) == pytest.approx(1.0)
    assert expected_tokens_from_survival(survival, 2) == pytest.approx(2.3)
    # (1 + 0.8) / 1.2 = 1.5, (2.3) / 1.4 = 1.643, (2.5) / 1.6 = 1.5625 -> K = 2
    k, value = best_k_from_survival(survival, 0.2)
    assert k == 2 and value == pytest.approx(2.3 / 1.4)
    with pytest.raises(ValueError, match="k: 4 exceeds the 3 measured positions"):
        expected_tokens_from_survival(survival, 4)


def test_alpha_from_steps_is_the_geometric_mle():
    # 3 + 1 + 0 accepted, two rejections (the full step has none), K=0 steps carry no information
    assert alpha_from_steps([(3, 3), (3, 1), (3, 0), (0, 0)]) == pytest.approx(4 / 6)
    assert alpha_from_steps([(2, 2), (2, 2)]) == pytest.approx(1.0)
    assert alpha_from_steps([(0, 0)]) == 0.0


def test_invalid_terms_name_the_value():
    with pytest.raises(ValueError, match="alpha: 1.5"):
        expected_tokens_per_step(1.5, 2)
    with pytest.raises(ValueError, match="survival: no measured positions"):
        best_k_from_survival([], 0.1)
    with pytest.raises(ValueError, match="verify_costs: 2 values for 3 positions"):
        speedups_from_survival([0.5, 0.2, 0.1], 0.1, [1.0, 1.1])
    with pytest.raises(ValueError, match="c: -1"):
        step_cost(1, -1.0)
