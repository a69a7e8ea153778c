"""What one engine step drafted, handed from the proposers to the verify.

The proposers fill it row by row (:meth:`StepBatch.put`); :meth:`StepBatch.seal` lays the proposals out as the
padded tensors the verify and the accept rule take. A row that drafts nothing this step (K = 0, or nobody with
anything to propose: a lookup without a match, Medusa heads before the row's first verify) has ``num_draft`` 0: its
verify is a plain decoding step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..methods import Method
from ..speculative.accept import PAD
from .request import SpecRequest


@dataclass
class StepBatch:
    requests: list[SpecRequest]  # [B] the decoding rows, in the order the scheduler runs them
    k: list[int] = field(default_factory=list)  # [B] each row's step_draft_len (within the policy's K for it)
    proposals: list[list[int]] = field(default_factory=list)  # [B][num_draft] each row's draft tokens
    proposal_probs: list[Tensor | None] = field(default_factory=list)  # [B] [num_draft, V] for sampled rows, else None
    proposer: list[Method | None] = field(default_factory=list)  # [B] who drafted each row (None: a plain step)
    # row -> the draft a model-free proposer found this step (its n-gram match or suffix-tree draft), asked once
    lookups: dict[int, list[int]] = field(default_factory=dict)
    # [B] a row whose proposal is a tree (Medusa): its TokenTree, the proposal being the nodes after the root in node
    # order; None for a chain (draft tokens one after another)
    trees: list = field(default_factory=list)
    # Laid out by seal():
    draft_tokens: Tensor | None = None  # [B, K] long, PAD after a row's own proposals; K = the widest row's count
    num_draft: Tensor | None = None  # [B] long
    draft_probs: Tensor | None = None  # [B, K, V] zeros after a row's proposals; None when no row samples
    # Set by the verify:
    first_logit: Tensor | None = None  # [B] long: where in the verify's logits row r's draft token 0 is judged

    def __post_init__(self):
        rows = len(self.requests)
        self.proposals = [[] for _ in range(rows)]
        self.proposal_probs = [None] * rows
        self.proposer = [None] * rows
        self.trees = [None] * rows

    def put(self, row: int, tokens: list[int], probs: Tensor | None, proposer: Method, tree=None) -> None:
        """Row ``row``'s proposal: ``tokens`` (at most k[row]) and, for a sampled row, the [len(tokens), V]
        distributions they were drawn from; or with ``tree`` its candidates, one per node after the root (their
        distributions are point masses: the tree's accept rule needs none)."""
        if tokens:
            self.proposals[row] = tokens
            self.proposal_probs[row] = probs
            self.proposer[row] = proposer
            self.trees[row] = tree

    def cut(self, row: int, keep: int) -> None:
        """Keep only the first ``keep`` tokens of chain row ``row``'s proposal (and their distributions); nothing
        left makes it a plain step."""
        if keep >= len(self.proposals[row]):
            return
        self.proposals[row] = self.proposals[row][:keep]
        probs = self.proposal_probs[row]
        self.proposal_probs[row] = probs[:keep] if probs is not None and keep else None
        if not keep:
            self.proposer[row] = None

    def seal(self, vocab: int, device: torch.device) -> None:
        """Lay out the chains: a tree row counts its candidates in num_draft but stays PAD in draft_tokens (the tree
        accept rule reads its proposal directly), so a wide tree does not widen the chain rows' tensors."""
        rows = len(self.requests)
        chains = [tokens if self.trees[row] is None else [] for row, tokens in enumerate(self.proposals)]
        width = max((len(tokens) for tokens in chains), default=0)
        self.num_draft = torch.tensor([len(tokens) for tokens in self.proposals], dtype=torch.long)
        self.draft_tokens = torch.full((rows, width), PAD, dtype=torch.long)
        for row, tokens in enumerate(chains):
            self.draft_tokens[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        if all(request.params.greedy or self.trees[row] is not None for row, request in enumerate(self.requests)):
            return
        self.draft_probs = torch.zeros(rows, width, vocab, device=device)
        for row, probs in enumerate(self.proposal_probs):
            if probs is not None:
                self.draft_probs[row, :probs.shape[0]] = probs
