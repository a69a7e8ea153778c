"""pipeline/speculative/tree_search.py: hit rates per rank, trees grown best first, the prefix that pays most."""

from __future__ import annotations

import itertools

import torch

from pipeline.speculative.tree import TokenTree
from pipeline.speculative.tree_search import best_tree, grow_tree, rank_hits


def test_rank_hits_are_shares_of_positions_per_head_and_rank():
    ranks = torch.tensor([[0, 1], [0, -1], [2, 0], [5, 0]])  # 4 positions, 2 heads; -1 and 5: not in the top 3
    hits = rank_hits(ranks, 3)
    assert hits.tolist() == [[0.5, 0.0, 0.25], [0.5, 0.25, 0.0]]


def _chance(hits, path):
    return float(torch.tensor([hits[d, r] for d, r in enumerate(path)]).prod())


def test_trees_grow_best_first_and_every_prefix_is_a_tree():
    hits = torch.tensor([[0.5, 0.2, 0.1], [0.6, 0.1, 0.05], [0.3, 0.3, 0.0]])
    grown = grow_tree(hits, 30)
    chances = [c for _, c in grown]
    assert chances == sorted(chances, reverse=True)
    for (path, chance) in grown:
        assert abs(chance - _chance(hits, path)) < 1e-6
    for n in range(1, len(grown) + 1):
        paths = [p for p, _ in grown[:n]]
        assert TokenTree.from_choices(paths).size == n + 1  # no missing parent
    # Nothing better was left out: every path not grown is no likelier than the last one grown.
    every = [list(p) for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)]
    left = [p for p in every if p not in [q for q, _ in grown] and _chance(hits, p) > 0]
    assert all(_chance(hits, p) <= chances[-1] + 1e-9 for p in left)


def test_the_best_prefix_depends_on_what_a_wide_verify_costs():
    hits = torch.tensor([[0.5, 0.2, 0.1], [0.6, 0.1, 0.05]])
    free = best_tree(hits, lambda n: 1.0, 63)  # a GPU-like verify: every candidate is worth its place
    assert len(free[0]) == len(grow_tree(hits, 63))
    assert abs(free[1] - (1 + sum(c for _, c in grow_tree(hits, 63)))) < 1e-6
    steep = best_tree(hits, lambda n: 1.0 + 0.3 * n, 63)  # each candidate costs 30% of a step: only the best one
    assert steep[0] == [[0]] and abs(steep[2] - 1.5 / 1.3) < 1e-6
    hopeless = best_tree(hits, lambda n: 1.0 + (2.0 if n else 0.0), 63)  # the heads cost more than they give
    assert hopeless[0] == [] and hopeless[2] == 1.0
