"""Medusa in the batching engine (pipeline/executor/proposers/medusa.py and the engine's tree verify).

The strongest check uses oracle heads: heads that know the target's greedy continuation (found by matching the
hidden state the engine hands them against hidden states of Hugging Face's own greedy run) and put the true token at
a chosen rank, so whole paths through non-first branches are accepted. Greedy output must then equal Hugging Face's
greedy output token for token across tree shapes and batches; that fails when a node's position is off (depth used
as position off by one), when the KV kept for an accepted path comes from another branch, or when the hidden state
handed to the heads is not the one at the last accepted position.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.executor import SpeculativeExecutor
from pipeline.executor.paged_kv_cache import PagedKVCache, _PagedLayer
from pipeline.medusa_heads import MedusaHeads
from pipeline.methods import Method
from pipeline.speculative.tree import TokenTree
from pipeline.speculative.tree_choices import tree_paths
from tests.conftest import load_tiny_models
from tests.executor.test_batching_engine_failures import fail_verify_of

PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n", "class Foo:\n    def __init__(self", "x = ["]
NEW = 24


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return load_tiny_models(tiny_pair)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)[0, len(ids):].tolist()


class OracleHeads(MedusaHeads):
    """Heads whose depth-d candidates hold the target's true greedy token d + 1 places after the position whose
    hidden state they read, at rank ``truth_rank[d]``; the other ranks hold tokens that are never right there."""

    def __init__(self, target, references: list[list[int]], truth_rank: list[int]):
        out = target.get_output_embeddings().weight
        super().__init__(len(truth_rank), 0, out.shape[1], out.shape[0])
        self.truth_rank = truth_rank
        self.states, self.futures = [], []
        with torch.no_grad():
            for sequence in references:  # prompt + greedy continuation
                hidden = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states[-1][0]
                for p in range(len(sequence)):
                    self.states.append(hidden[p])
                    self.futures.append(sequence[p + 2:])
        self.states = torch.stack(self.states)
        self.asked = 0

    def top_tokens(self, hidden, top_k):
        self.asked += hidden.shape[0]
        ranked = []
        nearest = torch.cdist(hidden.float(), self.states).argmin(-1)  # [R]
        for d, k in enumerate(top_k):
            rows = []
            for i in nearest.tolist():
                future = self.futures[i]
                true = future[d] if d < len(future) else 0
                wrong = [t for t in range(3, 3 + k + 1) if t != true][:k]
                if self.truth_rank[d] < k:
                    wrong[self.truth_rank[d]] = true
                rows.append(wrong)
            ranked.append(torch.tensor(rows))
        return ranked


def references(target, tok, prompts, n):
    ids = [tok(p)["input_ids"] for p in prompts]
    return ids, [hf_greedy(target, x, n) for x in ids]


TREES = {
    # name: (choices, rank of the true token per depth)
    "branchy": ([[0], [1], [1, 0], [1, 1], [0, 0], [1, 0, 0], [1, 0, 1], [1, 0, 1, 0]], [1, 0, 1, 0]),
    "default_63": ("mc_sim_7b_63", [0, 0, 0, 1]),
    "chain": ("chain4", [0, 0, 0, 0]),
    "wide_shallow": ([[0], [1], [2], [3], [2, 0]], [2, 0]),
}


@pytest.mark.parametrize("name", list(TREES))
def test_greedy_equals_hugging_face_across_trees_and_batches(pair, name):
    target, _, tok = pair
    choices, truth = TREES[name]
    ids, refs = references(target, tok, PROMPTS, NEW)
    heads = OracleHeads(target, [x + r for x, r in zip(ids, refs)], truth)
    ex = SpeculativeExecutor(target, None, tok, method="medusa", medusa=heads, medusa_choices=choices,
                             max_batch_size=3)  # 4 prompts: one joins as a row finishes
    batched = ex.generate(PROMPTS, NEW)
    alone = [ex.generate([p], NEW)[0] for p in PROMPTS[:2]]
    for result, want in zip(batched, refs):
        assert result.token_ids == want
    for result, want in zip(alone, refs):
        assert result.token_ids == want
    depth = TokenTree.from_choices(tree_paths(choices)).max_depth
    stats = batched[0].stats
    # Whole paths were accepted: the oracle's branch, to the tree's depth, in most steps.
    assert stats.mean_accepted_len > 1 + 0.6 * depth
    assert len(stats.drafted_at) == depth and stats.accepted_at[depth - 1] > 0
    assert stats.generated_tokens == stats.accepted_tokens + stats.target_steps
    assert stats.by_proposer[Method.MEDUSA][1] == stats.accepted_tokens
    assert heads.asked > 0


def test_rows_of_different_methods_share_one_batch(pair):
    target, draft, tok = pair
    ids, refs = references(target, tok, PROMPTS, NEW)
    heads = OracleHeads(target, [x + r for x, r in zip(ids, refs)], [1, 0, 1, 0])
    ex = SpeculativeExecutor(target, draft, tok, method="draft_model", medusa=heads, medusa_choices="mc_sim_7b_63")
    methods = ["medusa", "draft_model", "ngram", "medusa"]
    requests = [ex.new_request(p, NEW, method=m) for p, m in zip(PROMPTS, methods)]
    results = ex.run(requests)
    for result, want, method in zip(results, refs, methods):
        assert result.token_ids == want
        assert set(result.stats.by_proposer) <= {method}
    assert results[0].stats.mean_accepted_len > 2


def test_a_medusa_row_starts_plain_and_drafts_from_its_second_step(pair):
    target, _, tok = pair
    ids, refs = references(target, tok, PROMPTS[:1], NEW)
    heads = OracleHeads(target, [ids[0] + refs[0]], [0, 0, 0, 0])
    ex = SpeculativeExecutor(target, None, tok, method="medusa", medusa=heads, medusa_choices="chain4")
    events = list(ex.generate_stream(PROMPTS[0], NEW))
    assert len(events[0].token_ids) == 1  # no hidden state before the first verify: a plain step
    assert len(events[1].token_ids) == 5  # then the whole chain and the bonus token


def test_sampled_medusa_rows_are_reproducible_per_seed_whatever_the_batch(pair):
    target, _, tok = pair
    heads = MedusaHeads.from_target(target, 3, 1)
    ex = SpeculativeExecutor(target, None, tok, method="medusa", medusa=heads, medusa_choices=[[0], [1], [0, 0],
                                                                                                 [0, 0, 0]])
    together = ex.generate(PROMPTS, 16, temperature=0.9, seed=[5, 6, 7, 8])
    alone = ex.generate([PROMPTS[2]], 16, temperature=0.9, seed=7)
    assert together[2].token_ids == alone[0].token_ids
    assert all(len(r.token_ids) == 16 for r in together)


def test_heads_that_do_not_fit_the_target_are_refused(pair):
    target, _, tok = pair
    wrong = MedusaHeads(2, 1, 8, 50)
    with pytest.raises(ValueError, match="hidden size 8"):
        SpeculativeExecutor(target, None, tok, method="medusa", medusa=wrong)
    shallow = MedusaHeads.from_target(target, 2, 1)
    with pytest.raises(ValueError, match="4 deep but there are 2 heads"):
        SpeculativeExecutor(target, None, tok, method="medusa", medusa=shallow, medusa_choices="chain4")
    with pytest.raises(ValueError, match="needs Medusa heads"):
        SpeculativeExecutor(target, None, tok, method="medusa")


def test_the_cache_places_a_tree_by_depth_and_keeps_one_path():
    tree = TokenTree.from_choices([[0], [1], [1, 0], [1, 1]])  # nodes: root, [0], [1], [1,0], [1,1]
    cache = PagedKVCache(block_size=4, max_blocks=8, max_len=32)
    cache.open("a", list(range(10)))
    cache.open("b", list(range(10)))
    cache.lengths.update(a=3, b=5)
    positions, plan = cache.prepare(["a", "b"], [1 + 4, 2], "cpu", torch.float32, trees=[tree, None])
    assert positions[0].tolist() == [3, 4, 4, 5, 5, 5, 6]  # the root at 3, each node at root + depth; then b
    (group,) = plan.groups  # both rows are short: one attention group
    visible = group.mask[0, 0] == 0  # [5 query slots, kv]
    assert visible[:, :3].all()  # every node sees the cache before the root
    assert visible[:, 3:8].tolist() == tree.mask.tolist()
    assert group.slots.tolist() == [0, 1, 2, 3, 4, 5, 6] and not group.dense  # the chain row: 2 tokens, padded
    assert (group.mask[1, 0] == 0).sum(-1).tolist() == [6, 7, 7, 7, 7]  # causal; padding sees what its last sees

    layer = _PagedLayer(cache)
    # [blocks, block_size, heads, dim]: each position's value is its flat pool index
    layer.keys = torch.arange(8 * 4, dtype=torch.float32).view(8, 4, 1, 1)
    layer.values = layer.keys.clone()
    cache.layers.append(layer)
    flat = [block * 4 + offset for block in cache.pool.tables["a"] for offset in range(4)]  # a's positions
    other = layer.keys[cache.pool.tables["b"]].flatten().tolist()
    cache.keep_path("a", root=3, nodes=[2, 4])  # the path [1] -> [1, 1]: nodes 2 and 4
    a_keys = layer.keys.flatten()[flat].tolist()
    assert a_keys[3:6] == [flat[3], flat[5], flat[7]]  # root kept; nodes moved next to it
    assert layer.values.flatten()[flat][4:6].tolist() == [flat[5], flat[7]]
    assert layer.keys[cache.pool.tables["b"]].flatten().tolist() == other  # other sequences untouched


def test_a_row_failing_beside_medusa_rows_leaves_them_exactly_as_they_were(pair):
    """A step that fails for one row runs the others one at a time: each Medusa row must still keep the hidden state
    its own verify handed over (not only the last row's), so its tokens and statistics are those of a fault-free
    run; and nothing is kept for a request once it has left."""
    target, draft, tok = pair
    ids, refs = references(target, tok, PROMPTS, NEW)
    heads = OracleHeads(target, [x + r for x, r in zip(ids, refs)], [1, 0, 1, 0])
    kinds = [dict(), dict(temperature=0.9, seed=3), dict(method="draft_model"), dict()]

    def make():
        ex = SpeculativeExecutor(target, draft, tok, method="medusa", medusa=heads, medusa_choices="mc_sim_7b_63",
                                 max_batch_size=4)
        return ex, [ex.new_request(p, NEW, with_text=False, **kind) for p, kind in zip(PROMPTS, kinds)]

    ex, requests = make()
    fault_free = [(r.token_ids, r.stats.to_dict()) for r in ex.run(requests)]
    ex, requests = make()
    victim = requests[2]
    fail_verify_of(ex.engine, victim)
    for request in requests:
        ex.engine.add(request)
    while ex.engine.has_work():
        ex.engine.step()
    assert victim.finish_reason == "error"
    for i, request in enumerate(requests):
        if request is not victim:
            assert (request.generated, request.stats.to_dict()) == fault_free[i], i
    assert ex.engine.proposers[Method.MEDUSA]._hidden == {}
