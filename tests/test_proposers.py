"""The proposer interface: a drafter plugs in as one module plus its registry entry, the engine unchanged."""

from __future__ import annotations

import pytest
import torch

from conftest import load_tiny_models

from pipeline.executor import SpeculativeExecutor
from pipeline.executor import proposers
from pipeline.executor.proposers import Proposer
from pipeline.executor.step_batch import StepBatch
from pipeline.methods import Method


class RepeatLastToken(Proposer):
    """A test drafter: proposes the row's last token k times (one-hot distributions for sampled rows)."""

    method = Method.NGRAM  # registered in place of the lookup for this test

    def __init__(self, context):
        self.vocab_size, self.calls = context.vocab_size, []

    def propose(self, batch: StepBatch, rows: list[int]) -> None:
        self.calls.append(list(rows))
        for row in rows:
            tokens = [batch.requests[row].sequence[-1]] * batch.k[row]
            probs = None if batch.requests[row].params.greedy else \
                torch.nn.functional.one_hot(torch.tensor(tokens), self.vocab_size).float()
            batch.put(row, tokens, probs, self.method)


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return load_tiny_models(tiny_pair)


def test_a_registered_proposer_drafts_without_engine_changes(pair, monkeypatch):
    target, _, tok = pair
    monkeypatch.setitem(proposers.REGISTRY, Method.NGRAM, lambda context, built: RepeatLastToken(context))
    ex = SpeculativeExecutor(target, None, tok, max_draft_len=3, method="ngram", max_batch_size=4)
    mine = ex.engine.proposers[Method.NGRAM]
    assert isinstance(mine, RepeatLastToken)
    prompts = ["aaaa", "def f(x):\n    return x", "    ", "import os\n"]
    plain = ex.generate(prompts, 20, max_draft_len=0)
    results = ex.generate(prompts, 20)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]  # verified: greedy identity holds
    assert all(r.stats.draft_tokens > 0 for r in results)
    assert mine.calls and max(len(rows) for rows in mine.calls) > 1  # one call drafts all its rows of a step
    sampled = ex.generate(prompts, 12, temperature=0.9, seed=3)  # one-hot proposals under rejection sampling
    assert all(r.stats.draft_tokens > 0 and len(r.token_ids) == 12 for r in sampled)


def test_step_batch_lays_out_rows_padded():
    class Row:
        def __init__(self, greedy):
            self.params = type("P", (), {"greedy": greedy})()

    batch = StepBatch([Row(True), Row(False), Row(False)])
    batch.put(0, [5, 6, 7], None, Method.NGRAM)
    batch.put(1, [1], torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]), Method.DRAFT_MODEL)
    batch.put(2, [], None, Method.DRAFT_MODEL)  # nothing proposed: a plain step, no proposer recorded
    batch.seal(vocab=8, device=torch.device("cpu"))
    assert batch.draft_tokens.tolist() == [[5, 6, 7], [1, -1, -1], [-1, -1, -1]]
    assert batch.num_draft.tolist() == [3, 1, 0]
    assert batch.proposer == [Method.NGRAM, Method.DRAFT_MODEL, None]
    assert batch.draft_probs.shape == (3, 3, 8) and batch.draft_probs[1, 0, 1] == 1
    assert batch.draft_probs[1, 1:].sum() == 0 and batch.draft_probs[2].sum() == 0  # padding stays zero


def test_a_seeded_sampled_hybrid_row_does_not_depend_on_measured_costs(pair):
    """Which proposer drafts changes a sampled row's draws; the measured cost ratio (machine and batch speed) must
    not decide it for a seeded request, or its tokens would change with the load."""
    target, draft, tok = pair
    prompt = "x = compute(a, b)\ny = compute(a, b)\nz = compute("
    outcomes = []
    for draft_seconds in (1e-6, 1.0):  # a free draft model vs one that costs 1e5 verifies
        ex = SpeculativeExecutor(target, draft, tok, max_draft_len=4, method="ngram+draft")
        ex.engine.costs.record("draft", draft_seconds)
        ex.engine.costs.record("target", 1e-5)
        ex.engine._record = lambda role, tokens, seconds: None  # keep the measured ratio where it was set
        (result,) = ex.generate([prompt], 24, temperature=0.8, seed=11)
        outcomes.append((result.token_ids, result.stats.by_proposer))
    assert outcomes[0] == outcomes[1]
