"""The proposers (pipeline/executor/proposers/) inside the executor.

The proposer interface: a drafter plugs in as one module plus its registry entry, the engine unchanged. N-gram lookups
and the n-gram-or-draft choice give lossless greedy and sampled output and per-proposer statistics, and obey the
adaptive K cap.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.executor import SpeculativeExecutor, proposers
from pipeline.executor.draft_policy import COLD_START_TOKENS
from pipeline.executor.proposers import Proposer, choose_drafter
from pipeline.executor.step_batch import StepBatch
from pipeline.speculative.tree import TokenTree
from pipeline.methods import Method, NgramSettings, SuffixSettings
from pipeline.speculative.ngram import propose_ngram
from tests.conftest import load_tiny_models, tiny_vocab_model


class RepeatLastToken(Proposer):
    """A test drafter: proposes the row's last token k times (one-hot distributions for sampled rows)."""

    method = Method.DRAFT_MODEL  # registered in place of the draft model for this test

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
    target, draft, tok = pair
    monkeypatch.setitem(proposers.REGISTRY, Method.DRAFT_MODEL, lambda context, built: RepeatLastToken(context))
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=3, method="draft_model", max_batch_size=4)
    mine = ex.engine.proposers[Method.DRAFT_MODEL]
    assert isinstance(mine, RepeatLastToken)
    prompts = ["aaaa", "def f(x):\n    return x", "    ", "import os\n"]
    plain = ex.generate(prompts, 20, max_draft_len=0)
    results = ex.generate(prompts, 20)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]  # verified: greedy identity holds
    assert all(r.stats.draft_tokens > 0 for r in results)
    assert mine.calls and max(len(rows) for rows in mine.calls) > 1  # one call drafts all its rows of a step
    sampled = ex.generate(prompts, 12, temperature=0.9, seed=3)  # one-hot proposals under rejection sampling
    assert all(r.stats.draft_tokens > 0 and len(r.token_ids) == 12 for r in sampled)


class RecordStates(RepeatLastToken):
    """A test drafter that reads the target's aux-layer states: it keeps what target_states hands it per request,
    and drafts a chain or, every other step, a small tree (so both kinds of kept positions are exercised)."""

    wants_states = True
    TREE = TokenTree.from_choices([[0], [1], [0, 0]])

    def __init__(self, context):
        super().__init__(context)
        self.states: dict[int, list[torch.Tensor]] = {}

    def target_states(self, request, states) -> None:
        self.states.setdefault(request.id, []).append(states)

    def propose(self, batch: StepBatch, rows: list[int]) -> None:
        self.calls.append(list(rows))
        for row in rows:
            last = batch.requests[row].sequence[-1]
            if len(self.calls) % 2 and batch.k[row] >= 2 and batch.requests[row].params.greedy:
                batch.put(row, [last, (last + 1) % self.vocab_size, last], None, self.method, self.TREE)
            else:
                batch.put(row, [last] * batch.k[row], None, self.method)


def test_a_proposer_gets_the_aux_states_of_every_token_the_target_keeps(pair, monkeypatch):
    """Prompt chunks (a small step budget) and verifies (chains and trees, accepted and rejected drafts): the states
    handed over for a request, in order, are exactly the aux layers' outputs for its sequence but the last token,
    as one plain forward over that sequence computes them."""
    import functools

    from pipeline.executor import speculative_executor
    from pipeline.executor.batching_engine import BatchingEngine
    from pipeline.executor.model_runner import BatchModelRunner
    from pipeline.kv_settings import KVSettings

    target, draft, tok = pair
    monkeypatch.setitem(proposers.REGISTRY, Method.DRAFT_MODEL, lambda context, built: RecordStates(context))
    monkeypatch.setattr(speculative_executor, "BatchingEngine", functools.partial(BatchingEngine, aux_layers=(0, 1)))
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=3, method="draft_model", max_batch_size=4,
                             kv=KVSettings(block_size=4, prefix_reuse=False, step_tokens=12))
    mine = ex.engine.proposers[Method.DRAFT_MODEL]
    prompts = ["aaaa aaaa aaaa", "def f(x):\n    return x\n" * 2, "import os\n"]
    results = ex.run([ex.new_request(p, 16) for p in prompts])
    assert any(ex.engine.proposers[Method.DRAFT_MODEL].calls)
    reference = BatchModelRunner(target, "cpu", 256, 4, 64, aux_layers=(0, 1))
    for request_id, result in zip(sorted(mine.states), results):
        got = torch.cat(mine.states[request_id])  # [n, 2, d]
        sequence = ex.encode(prompts[results.index(result)]) + result.token_ids
        reference.open(request_id, [])
        reference.forward([request_id], [sequence[:-1]])
        assert got.shape == reference.aux_hidden[0].shape, (got.shape, len(sequence))
        assert (got - reference.aux_hidden[0]).abs().max() < 1e-4
    assert len(mine.states) == len(prompts)


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


REPEATING = ["x = compute(a, b)\ny = compute(a, b)\nz = compute(", "def f(self):\n    return self.value\n"
             "def g(self):\n    return self.", "import os\nimport sys\nimport "]


def hf_greedy(model, ids, n):
    x = torch.tensor([ids])
    return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)[0, len(ids):].tolist()


class FixedCost:
    """A cost ratio c that is not measured: tests of what the ngram+draft choice does get the same c on any machine."""

    def __init__(self, value: float):
        self.value = value

    def record(self, role: str, seconds: float) -> None:
        pass


@pytest.mark.parametrize("method", ["ngram", "ngram+draft"])
def test_greedy_output_is_the_target_greedy_output(pair, method):
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, None if method == "ngram" else draft, tok, max_draft_len=4, method=method)
    ex.engine.costs = FixedCost(0.3)  # the choice between lookup and draft must not follow this machine's load
    results = ex.generate(REPEATING, 40)
    for prompt, result in zip(REPEATING, results):
        assert result.token_ids == hf_greedy(target, tok(prompt)["input_ids"], 40)
        s = result.stats
        assert s.generated_tokens == 40 == s.accepted_tokens + s.target_steps
        for name, (drafted, accepted, steps) in s.by_proposer.items():
            assert name in ("ngram", "draft_model") and 0 <= accepted <= drafted and steps >= 1
        assert sum(d for d, _, _ in s.by_proposer.values()) == s.draft_tokens
    total = results[0].stats.merge(results[1].stats).merge(results[2].stats)
    assert total.by_proposer["ngram"][1] > 0  # lookups were proposed and accepted
    if method == "ngram":
        assert set(total.by_proposer) == {"ngram"}


def test_adaptive_draft_len_governs_lookup_rows(pair, monkeypatch):
    """Serving's adaptive K must cap n-gram rows too: a free proposal still widens the verify, and at a large batch
    that costs more than the lookups save (bench-serve measured 0.71x target-only before the cap applied)."""
    target, _, tok = pair
    ex = SpeculativeExecutor(target, None, tok, max_draft_len=4, method="ngram", adaptive_draft_len=True,
                             max_batch_size=4)
    seen = []

    def never_pays(rates, limits, uses_model=None, widths=None):
        seen.append(list(uses_model))
        return [0] * len(rates)

    monkeypatch.setattr(ex.engine.policy, "choose", never_pays)
    ex.engine.policy.drafted = COLD_START_TOKENS  # a warm engine: its probes follow the price alone
    capped = ex.generate(REPEATING, 24)
    assert seen and all(flags == [False] * len(flags) for flags in seen)  # lookup rows run no draft forward
    assert sum(r.stats.draft_tokens for r in capped) == 0
    named = ex.run([ex.new_request(tok(REPEATING[0])["input_ids"], 24, max_draft_len=4)])[0]
    assert named.stats.draft_tokens > 0  # a request that named its K is never capped
    assert named.token_ids == capped[0].token_ids


def test_each_row_drafts_the_k_the_policy_chose_for_it(pair, monkeypatch):
    """The policy's K is per row: the engine gives each request the K planned for its own id (one request held at
    0 drafts nothing while the one beside it drafts), and the tokens stay the target's."""
    target, _, tok = pair
    ex = SpeculativeExecutor(target, None, tok, max_draft_len=4, method="ngram", adaptive_draft_len=True,
                             max_batch_size=4)
    held = []

    def hold_the_first(rows, limits, uses_model=None, widths=None):
        held[:] = held or [min(rows)]  # the first request's id
        return [0 if row == held[0] else limit for row, limit in zip(rows, limits)]

    monkeypatch.setattr(ex.engine.policy, "plan", hold_the_first)
    first, second = ex.generate(REPEATING[:2], 24)
    assert first.stats.draft_tokens == 0 and second.stats.draft_tokens > 0
    assert second.token_ids == ex.generate(REPEATING[1:2], 24, max_draft_len=0)[0].token_ids


def test_choose_drafter_follows_each_proposers_record_and_cost(pair):
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=4, method="ngram+draft")

    def choice(request, cost_ratio=0.3):
        asked = []

        def lookup(k):
            asked.append(k)
            return propose_ngram(request.sequence, k, 1, 4)

        return choose_drafter(request, 4, lookup, cost_ratio), asked

    repeats = ex.new_request([5, 6, 7, 8, 5, 6, 7], 10)
    assert choice(repeats) == (Method.NGRAM, [4])  # no history: the lookup
    for _ in range(10):  # lookups always rejected, the draft model always accepted
        repeats.advance([], 4, 0, proposer=Method.NGRAM)
        repeats.advance([], 4, 4, proposer=Method.DRAFT_MODEL)
        repeats.finish_reason = None
    assert choice(repeats)[0] == Method.DRAFT_MODEL
    assert choice(repeats, cost_ratio=3.0)[0] == Method.NGRAM  # a draft that costs more than it saves
    assert choice(ex.new_request([5, 6, 7, 8], 10)) == (Method.DRAFT_MODEL, [4])  # no match
    assert choice(ex.new_request([5, 6, 7, 8], 10, method="ngram"))[0] is None  # no match, no model: a plain step
    assert choice(ex.new_request([5, 6, 5, 6], 10, method="ngram"))[0] == Method.NGRAM
    assert choice(ex.new_request([5, 6, 5, 6], 10, method="draft_model")) == (Method.DRAFT_MODEL, [])  # no lookup


def test_one_lookup_per_row_per_step_under_adaptive_draft_len(pair, monkeypatch):
    """The K policy asks what a lookup row can propose, then the row proposes: both from one lookup."""
    from pipeline.executor.proposers import ngram as ngram_proposer

    target, draft, tok = pair
    calls = []

    def counted(tokens, k, *args):
        calls.append(len(tokens))
        return propose_ngram(tokens, k, *args)

    monkeypatch.setattr(ngram_proposer, "propose_ngram", counted)
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=4, method="ngram+draft", adaptive_draft_len=True,
                             max_batch_size=4)
    # The policy's own choice follows step costs timed on this machine, and a busy machine can make it never draft
    # (then nothing is looked up and the test proves nothing): here drafting always pays, up to what rows can propose.
    monkeypatch.setattr(ex.engine.policy, "choose",
                        lambda rates, limits, uses_model=None, widths=None: max(limits, default=0))
    results = ex.generate(REPEATING[:3], 24)
    steps = sum(r.stats.target_steps for r in results)
    assert calls and len(calls) <= steps  # at most one per row per step (none on a plain step)


def test_ngram_needs_no_draft_and_draft_model_needs_one(pair):
    target, _, tok = pair
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeExecutor(target, None, tok, method="draft_model")
    with pytest.raises(ValueError, match="method"):
        SpeculativeExecutor(target, None, tok, method="lookup")
    ex = SpeculativeExecutor(target, None, tok, max_draft_len=3, method="ngram")
    assert ex.method == "ngram" and ex.engine.draft is None


REPEATS = [1, 2, 3, 1, 2, 3, 1, 2]
# After (1, 2) come 3, 4 or 5: drafting after a 1 (one-token match, four times the match drafted) branches there.
BRANCHES = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]


@pytest.mark.parametrize("method, temperature, top_k, prompt, tree", [
    ("ngram", 0.8, 0, REPEATS, False), ("ngram+draft", 1.3, 4, REPEATS, False), ("suffix", 0.8, 0, REPEATS, False),
    ("suffix", 1.1, 0, BRANCHES, True)], ids=["ngram", "ngram+draft", "suffix", "suffix-tree"])
def test_sampled_output_follows_the_target_distribution(method, temperature, top_k, prompt, tree, monkeypatch):
    """Lookups and the suffix trees' chains are one-hot proposals, their trees point masses; the first two sampled
    tokens must still follow the target's exact joint (TV < 0.07 at 3000 samples) and drafts must really have been
    proposed (the prompt repeats), as a tree where the test says so."""
    from pipeline.executor.proposers import suffix as suffix_module

    target, draft = tiny_vocab_model(1), tiny_vocab_model(2)
    trees = []
    real = suffix_module.TokenTree.from_parents
    monkeypatch.setattr(suffix_module.TokenTree, "from_parents",
                        lambda parents: trees.append(parents) or real(parents))

    def probs(ids):
        logits = target(torch.tensor([ids])).logits[0, -1].float() / temperature
        if top_k:
            logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], float("-inf"))
        return torch.softmax(logits, -1)

    with torch.no_grad():
        first = probs(prompt)
        exact = torch.stack([first[a] * probs(prompt + [a]) for a in range(6)]).flatten()
    ex = SpeculativeExecutor(target, draft if method == "ngram+draft" else None, None, max_draft_len=3,
                             method=method, max_batch_size=32,
                             suffix=SuffixSettings(tree=True, max_spec_factor=4.0) if tree else None)
    n = 3000
    # A step drafts at most one token fewer than are left: a tree needs a third token to have two candidates.
    results = ex.generate([prompt] * n, 3 if tree else 2, temperature=temperature, top_k=top_k,
                          seed=list(range(n)))
    pairs = torch.tensor([r.token_ids[0] * 6 + r.token_ids[1] for r in results])
    tv = 0.5 * (torch.bincount(pairs, minlength=36).float() / n - exact).abs().sum().item()
    assert tv < 0.07, tv
    lookup = "suffix" if method == "suffix" else "ngram"
    looked_up = sum(r.stats.by_proposer.get(lookup, [0, 0, 0])[0] for r in results)
    kept = sum(r.stats.by_proposer.get(lookup, [0, 0, 0])[1] for r in results)
    assert 0 < kept < looked_up
    assert bool(trees) == tree


def test_ngram_settings_are_used(pair):
    target, _, tok = pair
    strict = SpeculativeExecutor(target, None, tok, max_draft_len=4, method="ngram",
                                 ngram=NgramSettings(min_match=3, max_match=3))
    loose = SpeculativeExecutor(target, None, tok, max_draft_len=4, method="ngram")
    a = strict.generate(REPEATING, 30)
    b = loose.generate(REPEATING, 30)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert sum(r.stats.draft_tokens for r in a) < sum(r.stats.draft_tokens for r in b)
