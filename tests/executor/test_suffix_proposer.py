"""pipeline/executor/proposers/suffix.py: suffix decoding in the torch engine, on Arctic Inference's trees.

Lossless (greedy identity; the sampled distribution is in tests/executor/test_proposers.py), the request's own tree
fed as it grows, past outputs drafted from across requests but only within a salt, seeded sampled requests
reproducible whatever ran before, the settings read, and a clear refusal where the trees are not installed.
"""

from __future__ import annotations

import sys

import pytest

from pipeline.executor import SpeculativeExecutor
from pipeline.executor.proposers import suffix as suffix_module
from pipeline.executor.proposers.suffix import SuffixTrees
from pipeline.executor.request import SpecRequest
from pipeline.executor.request_values import DraftPlan
from pipeline.methods import Method, SuffixSettings, parse_method
from pipeline.speculative import SamplingParams
from tests.conftest import load_tiny_models

PROMPTS = ["def f(x):\n    return x\ndef f(x):\n    return", "import os\nimport os\nimport", "    ", "class A:\n"]


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return load_tiny_models(tiny_pair)


def _executor(pair, **kwargs) -> SpeculativeExecutor:
    target, _, tok = pair
    return SpeculativeExecutor(target, None, tok, max_draft_len=6, method="suffix", max_batch_size=4, **kwargs)


def _accepted(results) -> int:
    return sum(r.stats.by_proposer.get("suffix", [0, 0, 0])[1] for r in results)


def test_greedy_output_equals_target_only_and_past_outputs_are_drafted(pair):
    ex = _executor(pair)
    plain = ex.generate(PROMPTS, 40, max_draft_len=0)
    first = ex.generate(PROMPTS, 40)
    again = ex.generate(PROMPTS, 40)  # the same prompts: the first run's outputs are in the past-outputs tree
    assert [r.token_ids for r in first] == [r.token_ids for r in again] == [r.token_ids for r in plain]
    assert 0 < _accepted(first) < _accepted(again)
    assert sum(r.stats.target_steps for r in again) < sum(r.stats.target_steps for r in first)
    assert ex.engine.proposers[Method.SUFFIX].trees.running == 0  # every request's tree was dropped at its end


def test_without_past_outputs_a_repeat_drafts_no_more(pair):
    ex = _executor(pair, suffix=SuffixSettings(max_cached_requests=0))
    first, again = ex.generate(PROMPTS, 40), ex.generate(PROMPTS, 40)
    assert _accepted(first) == _accepted(again) > 0  # the prompts' own repeats only


def _salted(ex, salt):
    return ex.run([ex.new_request(prompt, 40, cache_salt=salt) for prompt in PROMPTS])


def test_past_outputs_are_shared_only_within_a_salt(pair):
    ex = _executor(pair)
    alone = _accepted(_salted(_executor(pair), "b"))
    _salted(ex, "a")
    other_salt = _accepted(_salted(ex, "b"))
    unsalted = _accepted(_salted(ex, None))
    same_salt = _accepted(_salted(ex, "a"))
    assert other_salt == alone == unsalted  # nothing of salt a's answers reached salt b, or the unsalted requests
    assert same_salt > alone


def test_a_seeded_sampled_request_does_not_depend_on_earlier_requests(pair):
    ex = _executor(pair)
    kwargs = {"temperature": 0.3, "seed": 11}
    before = ex.generate(PROMPTS, 30, **kwargs)
    for _ in range(2):
        ex.generate(PROMPTS, 30, temperature=0.8)  # fills the past-outputs tree with other samples
    after = ex.generate(PROMPTS, 30, **kwargs)
    assert [r.token_ids for r in after] == [r.token_ids for r in before]
    assert _accepted(before) > 0


def test_a_branching_draft_is_verified_as_a_tree(monkeypatch):
    """speculative.suffix.tree: where the counts branch, the candidates go to the verify as a tree (greedy output
    unchanged); without it the same prompts draft chains only."""
    from pipeline.executor.proposers import suffix as suffix_module
    from tests.conftest import tiny_vocab_model

    target = tiny_vocab_model(1)
    prompts = [[1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2], [3, 1, 2, 4, 3, 1, 2, 5, 3, 1]]
    counts = {}
    real = suffix_module.TokenTree.from_parents
    for tree in (False, True):
        made = []
        monkeypatch.setattr(suffix_module.TokenTree, "from_parents", lambda parents: made.append(1) or real(parents))
        ex = SpeculativeExecutor(target, None, None, max_draft_len=4, method="suffix",
                                 suffix=SuffixSettings(tree=tree, max_spec_factor=4.0))
        plain = ex.generate(prompts, 12, max_draft_len=0)
        drafted = ex.generate(prompts, 12)
        assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
        counts[tree] = len(made)
    assert counts[False] == 0 < counts[True]


def _request(prompt, generated=(), rid=None, salt=None, seeded=False, temperature=0.0) -> SpecRequest:
    import torch

    request = SpecRequest(list(prompt), 64, SamplingParams(temperature=temperature), DraftPlan(8, False, False),
                          torch.Generator(), seeded, frozenset(), frozenset(), method=Method.SUFFIX, cache_salt=salt)
    request.generated = list(generated)
    if rid is not None:
        request.id = rid
    return request


def test_the_trees_follow_the_output_and_keep_it_after_the_request_ends():
    trees = SuffixTrees(SuffixSettings())
    cycle = [5, 6, 7, 8, 9]
    request = _request([1, 2, 3])
    assert trees.draft(request, 4) == []  # nothing recurs yet
    request.generated = cycle + cycle[:3]  # its own output now repeats: fed before the next draft
    assert trees.draft(request, 4) == [8, 9, 5]  # at most as long as the match (5, 6, 7)
    assert trees.draft(request, 2) == [8, 9]  # at most K
    trees.release(request.id)
    other = _request([40, 41, 5, 6, 7])  # another request reaching the first one's output drafts its continuation
    assert trees.draft(other, 3) == [8, 9, 5]
    assert trees.running == 1


def test_the_draft_is_at_most_spec_factor_times_the_match():
    trees = SuffixTrees(SuffixSettings(max_spec_factor=1.0))
    request = _request([1, 2, 3, 4, 5, 6, 7, 8, 9, 1])
    assert trees.draft(request, 8) == [2]  # a one-token match drafts one token
    request.generated = [2, 3]
    assert trees.draft(request, 8) == [4, 5, 6]


def test_salts_beyond_the_limit_forget_the_least_recently_used_idle_one(monkeypatch):
    monkeypatch.setattr(suffix_module, "MAX_SALTS", 2)
    trees = SuffixTrees(SuffixSettings())
    running = _request([1, 2], salt="kept")
    trees.draft(running, 2)  # "kept" stays: a request of it is running
    for salt in ("x", "y", "z"):
        finished = _request([3, 4], salt=salt)
        trees.draft(finished, 2)
        trees.release(finished.id)
    assert list(trees._caches) == ["kept", "z"]


def test_method_suffix_is_refused_by_name_where_the_trees_are_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)
    with pytest.raises(ValueError, match="method: 'suffix' needs Arctic Inference's suffix tree .*`make setup`"):
        parse_method("suffix", has_draft_model=False)
