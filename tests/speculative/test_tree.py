"""pipeline/speculative/tree.py: candidate trees, their attention mask, and the greedy and sampled tree accept rules.

The sampled rule is checked against the target's exact distributions by sampling many independent rows (fixed
seeds, so the outcome is deterministic) and bounding the total variation as tests/e2e/test_sampling_distribution.py
does; the tree mask against running each path alone through a real (tiny) Llama.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.speculative.tree import (TokenTree, candidate_tokens, greedy_tree_accept, sampled_tree_accept,
                                       tree_attention_bias, uniforms_needed)

RECORDED_CHOICES = Path(__file__).parents[1] / "data/trtllm_1.1.0_medusa/FasterDecoding_Medusa/medusa/model/" \
                                                "medusa_choices.py"
SMALL = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]


def recorded_tree(name: str) -> list:
    """A named tree from the recorded FasterDecoding/Medusa file (read as data, never executed)."""
    for node in ast.parse(RECORDED_CHOICES.read_text()).body:
        if isinstance(node, ast.Assign) and node.targets[0].id == name:
            return [list(path) for path in ast.literal_eval(node.value)]
    raise KeyError(name)


def test_the_default_medusa_tree_has_its_63_nodes_by_depth():
    tree = TokenTree.from_choices(recorded_tree("mc_sim_7b_63"))
    assert tree.size == 64 and tree.paths[0] == ()
    assert [int((tree.depth == d).sum()) for d in range(1, 5)] == [10, 28, 23, 2]
    assert tree.top_k() == [10, 10, 10, 2]
    assert TokenTree.from_choices(recorded_tree("vicuna_7b_stage2")).size > 1


def test_leaves_alone_make_the_whole_tree_and_repeats_count_once():
    tree = TokenTree.from_choices([[1, 0], [1, 0], [0]])
    assert tree.paths == ((), (0,), (1,), (1, 0))
    assert tree.parent.tolist() == [-1, 0, 0, 2] and tree.rank.tolist() == [-1, 0, 1, 0]
    assert tree.children == ((1, 2), (), (3,), ()) and tree.path_to(3) == [2, 3]


@pytest.mark.parametrize("choices", [[], [[]], [[-1]], [[0, "1"]], [[True]], "0,1", [3]])
def test_bad_choices_are_named(choices):
    with pytest.raises(ValueError, match="choices"):
        TokenTree.from_choices(choices)


def test_a_tree_given_by_parents_keeps_each_candidate_under_its_parent():
    """Candidates in a parent-first order (a suffix tree's draft): 0 and 2 follow the root, 1 and 4 follow 0, 3
    follows 1; siblings keep their order as ranks, and every node maps back to its candidate."""
    parents = [-1, 0, -1, 1, 0]
    tree, order = TokenTree.from_parents(parents)
    assert tree.paths == ((), (0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert order == [0, 2, 1, 4, 3]
    for node, candidate in enumerate(order, start=1):  # the node's parent is its candidate's parent
        parent_node = int(tree.parent[node])
        assert (order[parent_node - 1] if parent_node else -1) == parents[candidate]
    with pytest.raises(ValueError, match="candidate 1 follows 3, which is not before it"):
        TokenTree.from_parents([-1, 3])


def test_a_node_sees_itself_and_its_ancestors_only():
    tree = TokenTree.from_choices(recorded_tree("mc_sim_7b_63"))
    for i, j in itertools.product(range(tree.size), repeat=2):
        assert bool(tree.mask[i, j]) == (tree.paths[i][:len(tree.paths[j])] == tree.paths[j]), (i, j)
    bias = tree_attention_bias(tree, torch.float32)
    assert torch.equal(bias == 0, tree.mask) and bias.min() == torch.finfo(torch.float32).min


def test_one_tree_forward_gives_every_node_the_logits_of_its_path_alone():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    tree = TokenTree.from_choices(SMALL)
    context = [3, 14, 15, 9, 26]  # the last one is the root: the token the tree grows from
    nodes = torch.randint(0, 50, (tree.size - 1,), generator=torch.Generator().manual_seed(1)).tolist()
    c = len(context)
    ids = torch.tensor([context + nodes])  # [1, c + N - 1]
    positions = torch.tensor([list(range(c)) + [c - 1 + int(d) for d in tree.depth[1:]]])
    total = c + tree.size - 1
    bias = torch.full((total, total), torch.finfo(torch.float32).min).triu(1)  # causal over the context
    bias[c - 1:, c - 1:] = tree_attention_bias(tree, torch.float32)  # the root is the context's last token
    bias[c:, :c - 1] = 0.0  # every node sees the whole context before the root
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions, attention_mask=bias[None, None]).logits[0]
        for node in range(tree.size):
            alone = context + [nodes[n - 1] for n in tree.path_to(node)]
            want = model(input_ids=torch.tensor([alone])).logits[0, -1]
            assert torch.allclose(logits[c - 1 + node], want, atol=1e-4), f"node {node} {tree.paths[node]}"


def test_candidates_take_each_depths_ranked_tokens():
    tree = TokenTree.from_choices(SMALL)
    ranked = [torch.tensor([[10, 11, 12]]), torch.tensor([[20, 21]]), torch.tensor([[30]])]
    tokens = candidate_tokens(tree, torch.tensor([7]), ranked)
    want = [7] + [ranked[len(p) - 1][0, p[-1]].item() for p in tree.paths[1:]]
    assert tokens[0].tolist() == want


def _greedy_by_hand(tree, tokens, argmax):
    best = 0
    for node in range(1, tree.size):
        path = tree.path_to(node)
        parents = [0] + path[:-1]
        if all(tokens[n] == argmax[p] for n, p in zip(path, parents)) and tree.depth[node] > tree.depth[best]:
            best = node
    return best, argmax[best]


def test_greedy_takes_the_deepest_matching_path_best_rank_first():
    tree = TokenTree.from_choices(SMALL)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 3, (500, tree.size), generator=generator)  # 3 tokens: matches are common
    argmax = torch.randint(0, 3, (500, tree.size), generator=generator)
    last, bonus = greedy_tree_accept(tree, tokens, argmax)
    for b in range(500):
        assert (int(last[b]), int(bonus[b])) == _greedy_by_hand(tree, tokens[b].tolist(), argmax[b].tolist())
    assert {int(tree.depth[n]) for n in last} == {0, 1, 2, 3}  # every depth occurred


# ---- sampling: the emitted tokens follow the target's distributions exactly -------------------------------------

VOCAB = 5
ROWS = 30000
SIGMAS = 4.5


def _tv_bound(probs: np.ndarray, samples: int) -> float:
    draws = np.random.default_rng(0).multinomial(samples, probs / probs.sum(), size=300) / samples
    tvs = 0.5 * np.abs(draws - probs / probs.sum()).sum(axis=1)
    return float(tvs.mean() + SIGMAS * tvs.std())


@pytest.fixture(scope="module")
def walk():
    """One sampled tree step on ROWS independent rows: a tree whose candidates hold the target's likely tokens
    (so paths are kept often) and some unlikely ones (so rejections and residuals happen)."""
    tree = TokenTree.from_choices(SMALL)
    generator = torch.Generator().manual_seed(3)
    probs = torch.distributions.Dirichlet(torch.full((VOCAB,), 0.7)).sample((tree.size,))  # [N, V]
    # Candidates: siblings hold distinct tokens (a head's top-k), ranked by the target's own preference at the
    # parent, except that the best-ranked child of the root is the target's least likely token there.
    tokens = torch.zeros(tree.size, dtype=torch.long)
    for node in range(tree.size):
        order = probs[node].argsort(descending=True).tolist()
        if node == 0:
            order = order[-1:] + order[:-1]
        for child in tree.children[node]:
            tokens[child] = order[int(tree.rank[child])]
    uniforms = torch.rand(ROWS, uniforms_needed(tree), generator=generator)
    last, final = sampled_tree_accept(tree, tokens.expand(ROWS, -1), probs.expand(ROWS, -1, -1), uniforms)
    return tree, probs, tokens, last, final


def _emitted(tree, tokens, last, final) -> list[list[int]]:
    return [[int(tokens[n]) for n in tree.path_to(int(node))] + [int(x)] for node, x in zip(last, final)]


def test_the_first_token_follows_the_target(walk):
    tree, probs, tokens, last, final = walk
    first = np.bincount([seq[0] for seq in _emitted(tree, tokens, last, final)], minlength=VOCAB) / ROWS
    exact = probs[0].double().numpy()
    tv = 0.5 * np.abs(first - exact).sum()
    assert tv < _tv_bound(exact, ROWS), f"first token {tv:.4f} from the target's distribution"
    assert len({int(tree.depth[n]) for n in last}) == 4  # paths of every depth were kept


def test_each_following_token_follows_the_target_after_its_path(walk):
    """Given a kept candidate path, the next emitted token follows the target's distribution at the path's end
    (a kept child's token, or the final draw when nothing below was kept)."""
    tree, probs, tokens, last, final = walk
    emitted = _emitted(tree, tokens, last, final)
    checked = 0
    for node in range(1, tree.size):
        path = [int(tokens[n]) for n in tree.path_to(node)]
        after = [seq[len(path)] for seq in emitted if seq[:len(path)] == path and len(seq) > len(path)]
        if len(after) < 2000:
            continue
        got = np.bincount(after, minlength=VOCAB) / len(after)
        exact = probs[node].double().numpy()
        tv = 0.5 * np.abs(got - exact).sum()
        assert tv < _tv_bound(exact, len(after)), f"after {tree.paths[node]}: {tv:.4f} from the target's"
        checked += 1
    assert checked >= 3


def test_a_row_reads_only_its_own_uniforms(walk):
    tree, probs, tokens, _, _ = walk
    uniforms = torch.rand(6, uniforms_needed(tree), generator=torch.Generator().manual_seed(5))
    together = sampled_tree_accept(tree, tokens.expand(6, -1), probs.expand(6, -1, -1), uniforms)
    for b in range(6):
        alone = sampled_tree_accept(tree, tokens[None], probs[None], uniforms[b:b + 1])
        assert (int(together[0][b]), int(together[1][b])) == (int(alone[0][0]), int(alone[1][0]))
