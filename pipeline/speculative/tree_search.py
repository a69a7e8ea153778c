"""A Medusa tree for given heads, prompts and machine: the candidates most likely to be accepted, as many as pay.

Input: how often head d ranked the target's true token at rank r (``rank_hits``, measured on the target's own greedy
text) and what a verify of n tokens costs relative to one plain step (measured). As in Medusa's tree construction, a
path's chance of being accepted is taken as the product of its ranks' hit rates along the depths (independence
across depths); a node adds that chance to the expected tokens of a step. Nodes are added best first (a child's
chance never exceeds its parent's, so every prefix of that order is a tree), and the tree kept is the prefix with
the most expected tokens per unit of step cost: on a GPU where a 64-token verify costs about one step that is a wide
tree, on a CPU where it does not, a narrow one.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from torch import Tensor


def rank_hits(ranks: Tensor, max_rank: int) -> Tensor:
    """ranks [P, H] long: at each of P positions, the rank head h gave the true token (>= max_rank or < 0: not
    among its top max_rank) -> [H, max_rank] the share of positions where head h ranked it r."""
    positions, heads = ranks.shape
    hits = ranks.new_zeros(heads, max_rank).float()
    for h in range(heads):
        inside = ranks[:, h][(ranks[:, h] >= 0) & (ranks[:, h] < max_rank)]
        hits[h].index_add_(0, inside, hits.new_ones(inside.shape[0]))
    return hits / max(positions, 1)


def grow_tree(hits: Tensor, max_nodes: int) -> list[tuple[list[int], float]]:
    """The ``max_nodes`` most likely paths (hits [H, R] from rank_hits), best first, each with its chance."""
    heads, ranks = hits.shape
    table = hits.tolist()
    frontier = [(-table[0][r], [r]) for r in range(ranks) if table[0][r] > 0]
    heapq.heapify(frontier)
    grown: list[tuple[list[int], float]] = []
    while frontier and len(grown) < max_nodes:
        negative, path = heapq.heappop(frontier)
        grown.append((path, -negative))
        depth = len(path)
        if depth < heads:
            for r in range(ranks):
                if table[depth][r] > 0:
                    heapq.heappush(frontier, (negative * table[depth][r], path + [r]))
    return grown


def best_tree(hits: Tensor, step_cost: Callable[[int], float], max_nodes: int) -> tuple[list[list[int]], float, float]:
    """The prefix of grow_tree's order with the most expected tokens per step over ``step_cost(nodes)`` (a step
    verifying that many candidates, in units of a plain decoding step, the heads included) -> (paths, expected
    tokens per step, expected speedup over plain decoding). Empty paths when no tree beats plain decoding."""
    best: tuple[list[list[int]], float, float] = ([], 1.0, 1.0 / step_cost(0))
    tokens = 1.0
    grown = grow_tree(hits, max_nodes)
    for n, (_, chance) in enumerate(grown, 1):
        tokens += chance
        speedup = tokens / step_cost(n)
        if speedup > best[2]:
            best = ([path for path, _ in grown[:n]], tokens, speedup)
    return best
