"""pipeline/bench/plan.py: bench's quick defaults, the K sweep, the full run they stand in for, and the flags'
errors, all decided before any model loads."""

from __future__ import annotations

import json
from collections import Counter
from argparse import Namespace
from pathlib import Path

import pytest

from pipeline.bench.plan import (DEFAULT_MAX_NEW_TOKENS, default_k_values, default_num_prompts, k_values_arg,
                                 plan_from_args)
from pipeline.config import load_config
from pipeline.errors import PipelineError

ROOT = Path(__file__).resolve().parents[2]


def _args(**overrides) -> Namespace:
    values = dict(prompts=None, prompt_set=None, num_prompts=None, max_new_tokens=DEFAULT_MAX_NEW_TOKENS, k_max=8,
                  k_values=None, repeats=3, skip_hf=False)
    return Namespace(**{**values, **overrides})


@pytest.mark.parametrize("k_max, expected", [(8, [1, 2, 4, 8]), (6, [1, 2, 4, 6]), (3, [1, 2, 3]), (1, [1]),
                                             (16, [1, 2, 4, 8, 16])])
def test_the_default_sweep_is_powers_of_two_then_k_max(k_max, expected):
    assert default_k_values(k_max) == expected


@pytest.mark.parametrize("sets, per_set", [(1, 4), (2, 2), (3, 1), (4, 1), (9, 1)])
def test_default_prompts_are_shared_among_the_sets_at_least_one_each(sets, per_set):
    assert default_num_prompts(sets) == per_set


def test_k_values_flag():
    assert k_values_arg("8, 2,1,2") == [1, 2, 8] and k_values_arg("all") == "all"
    with pytest.raises(PipelineError, match=r"--k-values: 'two' is not a comma list of integers"):
        k_values_arg("two")


def test_the_shipped_tasks_file_gets_the_quick_plan_and_names_the_full_one():
    """The new-user trial ran `bench --prompts prompts/tasks.jsonl` at its defaults for 35-40 minutes: 20 prompts x
    64 tokens x K 1..8 x 3 repeats. The defaults are a run about ten times smaller."""
    tasks = ROOT / "prompts" / "tasks.jsonl"
    counts = dict(Counter(json.loads(line)["set"] for line in tasks.read_text().splitlines()))
    config = load_config(ROOT / "configs" / "smollm2-135m-ngram.yaml")
    plan = plan_from_args(_args(prompts=tasks), config)
    assert {name: len(items) for name, items in plan.prompt_sets.items()} == {name: 1 for name in counts}
    assert (plan.max_new_tokens, plan.k_values, plan.repeats) == (32, [1, 2, 4, 8], 3)
    assert plan.full_sizes == counts
    assert plan.full_flags() == f"--num-prompts {max(counts.values())} --max-new-tokens 64 --k-values all --repeats 3"
    assert not plan.is_full()
    full = plan_from_args(_args(prompts=tasks, num_prompts=max(counts.values()), max_new_tokens=64,
                                k_values="all"), config)
    assert full.is_full() and full.k_values == list(range(1, 9))
    assert sum(map(len, full.prompt_sets.values())) == sum(counts.values())


def test_builtin_sets_share_the_default_prompts():
    config = load_config(ROOT / "configs" / "tiny.yaml")
    one = plan_from_args(_args(), config)
    assert list(one.prompt_sets) == ["code"] and len(one.prompt_sets["code"]) == 4
    every = plan_from_args(_args(prompt_set="all"), config)  # 4 prompts shared among the 4 sets
    assert {name: len(p) for name, p in every.prompt_sets.items()} == {"code": 1, "json": 1, "prose": 1, "agentic": 1}
    assert every.full_sizes == {"code": 8, "json": 8, "prose": 8, "agentic": 8}


@pytest.mark.parametrize("overrides, message", [
    (dict(k_values=[1, 9]), "--k-values: 9 must be between 1 and 8; raise --k-max"),
    (dict(num_prompts=0), "--num-prompts: 0 must be >= 1"),
    (dict(repeats=0), "--repeats: 0 must be >= 1"),
    (dict(prompt_set="code", prompts=Path("x.txt")), "--prompt-set and --prompts: pass one of them"),
])
def test_bad_flags_are_named(overrides, message):
    with pytest.raises(PipelineError, match=message):
        plan_from_args(_args(**overrides), load_config(ROOT / "configs" / "tiny.yaml"))
