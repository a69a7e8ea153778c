"""pipeline/bench/prompts.py: the built-in prompt sets are deterministic and non-empty."""

from __future__ import annotations


def test_prompt_sets_are_deterministic_and_nonempty():
    from pipeline.bench.prompts import PROMPT_SETS, load_prompt_set

    for name in PROMPT_SETS:
        first, again = load_prompt_set(name, 3), load_prompt_set(name, 3)
        assert first == again and len(first) == 3 and all(p.strip() for p in first)
    assert load_prompt_set("code", 2)[0].rstrip().endswith(":")  # ends on a def line
    assert load_prompt_set("json", 1)[0].endswith('"name": "')
