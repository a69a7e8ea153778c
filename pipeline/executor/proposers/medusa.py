"""Medusa heads as a proposer: a tree of candidates from the heads' top-k, read off the target's own hidden state.

The heads read the final hidden state at the position the last verify accepted up to (the engine hands it over in
:meth:`MedusaProposer.verified`), so drafting costs no model forward: head h ranks the token h + 2 places after that
position, i.e. h + 1 after the root (the token the verify emitted last). Each row's candidates fill the configured
tree (``speculative.medusa.choices``), cut to the row's K as its depth; the engine verifies the tree in one target
forward. A row's first step has no hidden state yet: it runs plain and yields one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...methods import Method
from ...speculative.tree import TokenTree, candidate_tokens
from ..step_batch import StepBatch
from .base import Proposer, ProposerContext


class MedusaProposer(Proposer):
    method = Method.MEDUSA
    wants_hidden = True

    def __init__(self, context: ProposerContext):
        self.heads, self.tree = context.medusa
        self._trees: dict[int, TokenTree] = {self.tree.max_depth: self.tree}  # depth -> the tree cut to it
        self._hidden: dict[int, Tensor] = {}  # request id -> [d] final hidden state where its last verify ended

    def tree_for(self, depth: int) -> TokenTree:
        """The configured tree without its paths deeper than ``depth``."""
        depth = min(depth, self.tree.max_depth)
        if depth not in self._trees:
            self._trees[depth] = TokenTree.from_choices([list(p) for p in self.tree.paths[1:] if len(p) <= depth])
        return self._trees[depth]

    def verify_width(self, k: int) -> int:
        """Tokens a step verifies with the tree cut to depth k: the root and the nodes (the K policy prices it)."""
        return self.tree_for(k).size if k > 0 else 1

    def limit(self, batch: StepBatch, row: int, k: int) -> int:
        return min(k, self.tree.max_depth) if batch.requests[row].id in self._hidden else 0

    @torch.inference_mode()
    def propose(self, batch: StepBatch, rows: list[int]) -> None:
        hidden = torch.stack([self._hidden[batch.requests[row].id] for row in rows])  # [R, d]
        ranked = self.heads.top_tokens(hidden, self.tree.top_k())  # per depth [R, k_d]
        for i, row in enumerate(rows):
            request = batch.requests[row]
            tree = self.tree_for(batch.k[row])
            root = torch.tensor([request.sequence[-1]])
            tokens = candidate_tokens(tree, root, [r[i:i + 1].cpu() for r in ranked[:tree.max_depth]])  # [1, N]
            batch.put(row, tokens[0, 1:].tolist(), None, self.method, tree)

    def verified(self, requests: list, hidden: Tensor) -> None:
        """Rows of this step that use Medusa and their hidden states [R, d] at their last accepted position."""
        for i, request in enumerate(requests):
            self._hidden[request.id] = hidden[i]

    def release(self, request_id: int) -> None:
        self._hidden.pop(request_id, None)
