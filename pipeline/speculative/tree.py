"""Tree verification: many draft candidates checked in one target forward, with the target's output kept exact.

A tree comes as ``choices``: paths from the root, each a list of ranks. ``[a, b]`` is the candidate of rank ``b``
at depth 2 under the candidate of rank ``a`` at depth 1 (rank 0 = a head's most likely token); the format of
TensorRT-LLM's ``medusa_choices`` and FasterDecoding/Medusa's trees. Node 0 is the root: the last token already
accepted. Nodes are numbered by depth, then by path, so a parent always precedes its children.

The target verifies every node in one forward: node i sits at position (root's position + depth(i)) and attends to
the cache, the root and its own ancestors only (``TokenTree.mask``), so its logits are those it would get were its
path run alone.

Greedy: the deepest path whose every token equals the target's argmax after its parent (between paths of one depth,
the first in node order, i.e. the better-ranked), then the target's argmax after the path's last node: exactly the
target's own greedy tokens.

Sampling, lossless over the tree: from the root down, the current node's children are tried in rank order, each as
a point mass. Child token x is kept with probability r(x) / sum(r), where r is the target's distribution at the
current node with the tokens of the siblings already rejected removed; the first kept child becomes the current
node. When every child is rejected (or there is none), the next token is drawn from r renormalised. By induction
over the siblings tried, the token emitted at each depth follows the target's distribution given the text so far
(the sequential form of SpecInfer's multi-candidate rejection with deterministic candidates), whatever the
candidates are; they only decide how often the tree saves a forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .sampling import sample_inverse_cdf


@dataclass(frozen=True)
class TokenTree:
    paths: tuple[tuple[int, ...], ...]  # [N] node i's ranks from the root; node 0 (the root) is ()
    parent: Tensor  # [N] long, -1 for the root
    depth: Tensor  # [N] long, 0 for the root
    rank: Tensor  # [N] long: which candidate of its depth's proposer the node takes; -1 for the root
    mask: Tensor  # [N, N] bool: node i may attend to node j (j is i or one of its ancestors)
    children: tuple[tuple[int, ...], ...]  # [N] each node's children, best rank first

    @property
    def size(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return max(len(p) for p in self.paths)

    def top_k(self) -> list[int]:
        """Candidates each depth's proposer must rank: 1 + the largest rank used at that depth."""
        return [1 + max(p[d - 1] for p in self.paths if len(p) >= d) for d in range(1, self.max_depth + 1)]

    @classmethod
    def from_choices(cls, choices) -> TokenTree:
        """The tree of ``choices`` (a list of rank paths). A path's missing prefixes are added (a list of leaves
        is a whole tree); repeats count once."""
        if not isinstance(choices, (list, tuple)) or not choices:
            raise ValueError("choices: must be a non-empty list of paths such as [[0], [0, 0], [1]]")
        paths: set[tuple[int, ...]] = set()
        for path in choices:
            if not isinstance(path, (list, tuple)) or not path or \
                    not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path):
                raise ValueError(f"choices: {path!r} is not a path: each one is a non-empty list of ranks >= 0, "
                                 f"such as [0, 1]")
            for end in range(1, len(path) + 1):
                paths.add(tuple(path[:end]))
        ordered = [()] + sorted(paths, key=lambda p: (len(p), p))
        index = {path: i for i, path in enumerate(ordered)}
        parent = [-1] + [index[p[:-1]] for p in ordered[1:]]
        n = len(ordered)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                mask[i, j] = True
                j = parent[j]
        children = tuple(tuple(c for c in range(1, n) if parent[c] == i) for i in range(n))
        return cls(tuple(ordered), torch.tensor(parent), torch.tensor([len(p) for p in ordered]),
                   torch.tensor([-1] + [p[-1] for p in ordered[1:]]), mask, children)

    @classmethod
    def from_parents(cls, parents: list[int]) -> tuple[TokenTree, list[int]]:
        """A tree given as candidates in a parent-first order (``parents[i]``: the candidate before i it follows,
        -1 for the root; siblings best first), and for each of its nodes after the root the candidate it is."""
        paths: list[tuple[int, ...]] = []
        children = [0] * (len(parents) + 1)  # per candidate (and the root, last): its children so far
        for i, parent in enumerate(parents):
            if not -1 <= parent < i:
                raise ValueError(f"parents: candidate {i} follows {parent}, which is not before it")
            paths.append((paths[parent] if parent >= 0 else ()) + (children[parent],))
            children[parent] += 1
        tree = cls.from_choices([list(p) for p in paths])
        where = {path: i for i, path in enumerate(paths)}
        return tree, [where[path] for path in tree.paths[1:]]

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's first child down to ``node`` (empty for the root)."""
        path = []
        while node > 0:
            path.append(node)
            node = int(self.parent[node])
        return path[::-1]


def candidate_tokens(tree: TokenTree, root_tokens: Tensor, ranked: list[Tensor]) -> Tensor:
    """root_tokens [B], ranked[d] [B, >= top_k()[d]] (depth d+1's candidates, best first) -> tokens [B, N]."""
    tokens = root_tokens.new_empty(root_tokens.shape[0], tree.size)
    tokens[:, 0] = root_tokens
    for node in range(1, tree.size):
        tokens[:, node] = ranked[int(tree.depth[node]) - 1][:, int(tree.rank[node])]
    return tokens


def greedy_tree_accept(tree: TokenTree, tokens: Tensor, target_argmax: Tensor) -> tuple[Tensor, Tensor]:
    """tokens [B, N] (the candidates, root included), target_argmax [B, N] (the target's argmax after each node)
    -> (the accepted path's last node [B], the target's token after it [B])."""
    batch = tokens.shape[0]
    ok = torch.zeros(batch, tree.size, dtype=torch.bool, device=tokens.device)
    ok[:, 0] = True
    parent = tree.parent.to(tokens.device)
    for node in range(1, tree.size):  # parents precede children
        p = int(parent[node])
        ok[:, node] = ok[:, p] & (tokens[:, node] == target_argmax[:, p])
    # Deepest accepted node; among equals the first (best-ranked) one: depth * N - index is largest there.
    score = tree.depth.to(tokens.device) * tree.size - torch.arange(tree.size, device=tokens.device)
    last = torch.where(ok, score, torch.full_like(score, -tree.size)).argmax(-1)  # [B]
    return last, target_argmax.gather(-1, last[:, None]).squeeze(-1)


def uniforms_needed(tree: TokenTree) -> int:
    """Uniform draws one row's sampled walk can use: one per sibling tried on the widest path, plus the final."""
    def widest(node: int) -> int:
        kids = tree.children[node]
        return max((len(kids) + widest(c) for c in kids), default=0)

    return widest(0) + 1


def sampled_tree_accept(tree: TokenTree, tokens: Tensor, target_probs: Tensor,
                        uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """tokens [B, N], target_probs [B, N, V] (the target's sampling distribution after each node, warped),
    uniforms [B, >= uniforms_needed(tree)] in [0, 1), each row's own -> (last kept node [B], next token [B]).

    Row by row (the walk's length differs per row); each row reads only its own uniforms, so its result does not
    depend on the rest of the batch."""
    batch = tokens.shape[0]
    last = torch.zeros(batch, dtype=torch.long, device=tokens.device)
    final = torch.zeros(batch, dtype=torch.long, device=tokens.device)
    for b in range(batch):
        node, used = 0, 0
        while True:
            residual = target_probs[b, node].clone()  # [V]
            kept = None
            for child in tree.children[node]:
                x = int(tokens[b, child])
                total = residual.sum()
                keep = bool(uniforms[b, used] * total < residual[x])
                used += 1
                if keep:
                    kept = child
                    break
                residual[x] = 0.0
            if kept is None:
                break
            node = kept
        total = residual.sum()
        if total <= 0:  # rounding left nothing: the target's own distribution at this node
            residual, total = target_probs[b, node], target_probs[b, node].sum()
        last[b] = node
        final[b] = sample_inverse_cdf((residual / total)[None], uniforms[b, -1:])[0]
    return last, final


def tree_attention_bias(tree: TokenTree, dtype: torch.dtype, device=None) -> Tensor:
    """[N, N] additive mask among the tree's nodes: 0 where ``mask`` allows, the dtype's minimum elsewhere (the
    convention of the runner's masks; everything cached before the root stays visible to every node)."""
    blocked = torch.zeros(tree.size, tree.size, dtype=dtype, device=device)
    return blocked.masked_fill(~tree.mask.to(device), torch.finfo(dtype).min)
