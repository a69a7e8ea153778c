"""The draft model as a proposer: one batched draft forward per draft position for every row it drafts."""

from __future__ import annotations

import time

import torch

from ...methods import Method
from ...speculative import logits_to_probs, sample
from ..row_logits import adjusted, adjusts
from ..step_batch import StepBatch
from .base import Proposer, ProposerContext


class DraftModelProposer(Proposer):
    method = Method.DRAFT_MODEL
    uses_model = True

    def __init__(self, context: ProposerContext):
        self.runner = context.draft_runner  # a BatchModelRunner holding a sequence per request id
        self.kv_runner = self.runner
        self.target = context.target_runner
        self.vocab_size = context.vocab_size
        self.record = context.record_draft

    def catch_up(self, requests: list) -> None:
        """The draft's KV up to the target's for these rows, in one packed draft forward."""
        rows = [r for r in requests if self.runner.length(r.id) < self.target.length(r.id)]
        if rows:
            inputs = [r.sequence[self.runner.length(r.id):self.target.length(r.id)] for r in rows]
            self.runner.forward([r.id for r in rows], inputs, logits_for=[0] * len(rows))

    def propose(self, batch: StepBatch, rows: list[int]) -> None:
        tokens: dict[int, list[int]] = {row: [] for row in rows}
        probs: dict[int, list] = {row: [] for row in rows}
        for position in range(max(batch.k[row] for row in rows)):
            start = time.perf_counter()
            active = [row for row in rows if position < batch.k[row]]
            inputs = [batch.requests[row].sequence[self.runner.length(batch.requests[row].id):] if position == 0
                      else [tokens[row][-1]] for row in active]  # position 0 catches up on what the draft has not seen
            logits = self.runner.forward([batch.requests[row].id for row in active], inputs,
                                         logits_for=[1] * len(active))[:, 0, :self.vocab_size]  # [active, V]
            greedy = logits.argmax(-1)  # [active]
            for i, row in enumerate(active):
                request = batch.requests[row]
                # The request's penalties, bias and grammar along the draft's own chain, as the verify applies them.
                row_logits = adjusted(request, logits[i][None], [tokens[row]]) if adjusts(request) else None
                if request.params.greedy:
                    tokens[row].append(int(greedy[i]) if row_logits is None else int(row_logits.argmax()))
                else:
                    row_logits = logits[i][None] if row_logits is None else row_logits  # [1, V]
                    row_probs = logits_to_probs(row_logits, request.params)  # [1, V]
                    tokens[row].append(int(sample(row_probs, request.generator)))
                    probs[row].append(row_probs)
            # One draft position costs its forward plus the per-row sampling around it: record both.
            self.record(len(active), time.perf_counter() - start)
        for row in rows:
            batch.put(row, tokens[row], torch.cat(probs[row]) if probs[row] else None, self.method)
