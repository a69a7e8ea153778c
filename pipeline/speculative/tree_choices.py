"""Named Medusa trees (``speculative.medusa.choices``): each a list of rank paths, see pipeline.speculative.tree.

``mc_sim_7b_63`` is the tree FasterDecoding/Medusa found by simulation for Vicuna-7B and TensorRT-LLM uses when no
``medusa_choices`` is given (63 nodes, depth 4, top-k per depth 10/10/10/2). It pays where verifying 64 tokens
costs about one step (a large model on a GPU); on a CPU a wide verify is not free, and the small trees below verify
fewer candidates: ``chain4`` only the heads' best guesses, ``small15`` a few alternatives at the shallow depths where
the heads are most often right.
"""

from __future__ import annotations

MC_SIM_7B_63 = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5], [0, 0, 1],
    [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0],
    [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6],
    [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2],
    [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1],
    [1, 6], [0, 7, 0],
]

NAMED_TREES: dict[str, list[list[int]]] = {
    "mc_sim_7b_63": MC_SIM_7B_63,
    "chain4": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]],
    "small15": [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0],
                [1, 0, 0], [0, 0, 0, 0]],
}
DEFAULT_TREE = "mc_sim_7b_63"


def tree_paths(choices: str | list) -> list:
    """A tree as ``speculative.medusa.choices`` gives it, a name or paths, as paths."""
    return NAMED_TREES[choices] if isinstance(choices, str) else choices
