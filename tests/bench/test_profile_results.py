"""pipeline/bench/profile_results.py: a candidate's figures per set label from the same generations, and a
recommendation per set beside the overall one."""

from __future__ import annotations

import pytest

from pipeline.bench.profile_results import (DraftProfile, by_label, chain_figures, format_per_set,
                                            per_set_recommendations, recommendation)
from pipeline.executor import GenerationStats

VERIFY = [1.1, 1.2, 1.3]


def _stats(steps, tokens):
    """GenerationStats of one request: ``steps`` as (drafted, accepted) per target step."""
    stats = GenerationStats(generated_tokens=tokens)
    for drafted, accepted in steps:
        stats.record_step(drafted, accepted)
    return stats


def test_figures_come_from_the_sets_own_requests():
    copies = [_stats([(3, 3), (3, 2)], 7), _stats([(3, 3)], 4)]  # lookups that copy text: long accepted runs
    fresh = [_stats([(3, 0), (0, 0), (3, 1)], 4)]
    labels = ["code", "prose", "code"]
    groups = by_label(labels, [copies[0], fresh[0], copies[1]])
    assert list(groups) == ["code", "prose"] and groups["code"] == copies
    code = chain_figures(groups["code"], 3, 0.0, VERIFY, per_step=True)
    prose = chain_figures(groups["prose"], 3, 0.0, VERIFY, per_step=True)
    assert code.prompts == 2 and code.acceptance_by_position == [1.0, 1.0, 2 / 3]  # per target step
    assert prose.acceptance_by_position == [1 / 3, 0.0, 0.0]  # the step without a match weighs in
    assert code.expected_speedup[2] == pytest.approx((1 + 1 + 1 + 2 / 3) / 1.3)
    assert (code.best_k, prose.best_k) == (3, 1)
    per_proposal = chain_figures(fresh, 3, 0.2, VERIFY)
    assert per_proposal.acceptance_by_position == [0.5, 0.0, 0.0]  # of the two steps that proposed


def _profiles():
    draft = DraftProfile("d", "ok", best_k=2, best_speedup=1.3)
    lookup = DraftProfile("ngram", "ok", best_k=4, best_speedup=1.2, method="ngram")
    draft.per_set = {"code": chain_figures([_stats([(2, 0)], 1)], 2, 0.3, VERIFY),
                     "prose": chain_figures([_stats([(2, 2)], 3)], 2, 0.3, VERIFY)}
    lookup.per_set = {"code": chain_figures([_stats([(2, 2)], 3)], 2, 0.0, VERIFY, per_step=True),
                      "prose": chain_figures([_stats([(0, 0)], 1)], 2, 0.0, VERIFY, per_step=True)}
    return [draft, lookup, DraftProfile("gone", "unavailable", "not found")]


def test_each_set_gets_its_own_recommendation():
    profiles = _profiles()
    assert recommendation(profiles).startswith("recommend: speculative.method: draft_model with draft d")
    code, prose = per_set_recommendations(profiles)
    assert code.startswith("recommend for set code (1 prompts): speculative.method: ngram with "
                           "speculative.max_draft_len: 2")
    assert prose.startswith("recommend for set prose (1 prompts): speculative.method: draft_model with draft d")
    assert profiles[0].for_set("code").best_speedup == profiles[0].per_set["code"].best_speedup
    assert profiles[2].for_set("code").status == "unavailable"


def test_one_label_needs_no_per_set_lines():
    profiles = _profiles()
    for p in profiles:
        p.per_set = {k: v for k, v in p.per_set.items() if k == "code"}
    assert per_set_recommendations(profiles) == [] and format_per_set(profiles) == ""


def test_the_per_set_table_has_a_column_per_set():
    header, draft, lookup = format_per_set(_profiles()).splitlines()
    assert header.split() == ["best", "K", "per", "set", "code", "prose"]
    assert draft.split()[0] == "d" and len(draft.split()) == 5 and lookup.split()[0] == "ngram"
