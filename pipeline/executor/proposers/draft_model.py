"""The draft model as a proposer: one batched draft forward per draft position for every row it drafts."""

from __future__ import annotations

import time

import torch

from ...methods import Method
from ...speculative import logits_to_probs, sample
from ..step_batch import StepBatch
from .base import Proposer, ProposerContext


class DraftModelProposer(Proposer):
    method = Method.DRAFT_MODEL
    uses_model = True

    def __init__(self, context: ProposerContext):
        self.runner = context.draft_runner  # a BatchModelRunner whose slots are the engine's rows
        self.vocab_size = context.vocab_size
        self.record = context.record_draft

    def propose(self, batch: StepBatch, rows: list[int]) -> None:
        chosen = set(rows)
        tokens: dict[int, list[int]] = {row: [] for row in rows}
        probs: dict[int, list] = {row: [] for row in rows}
        for position in range(max(batch.k[row] for row in rows)):
            start = time.perf_counter()
            inputs: list[list[int]] = []
            for row, request in enumerate(batch.requests):
                if row not in chosen or position >= batch.k[row]:
                    inputs.append([])
                elif position == 0:  # catch up on every token the draft has not seen
                    inputs.append(request.sequence[self.runner.length(row):])
                else:
                    inputs.append([tokens[row][-1]])
            used = max(row for row, ids in enumerate(inputs) if ids) + 1
            logits = self.runner.forward(inputs[:used])[..., :self.vocab_size]  # [used, width, V]
            greedy = logits.argmax(-1)  # [used, width]
            for row in range(used):
                if not inputs[row]:
                    continue
                request, last = batch.requests[row], len(inputs[row]) - 1
                if request.params.greedy:
                    tokens[row].append(int(greedy[row, last]))
                else:
                    row_probs = logits_to_probs(logits[row, last][None], request.params)  # [1, V]
                    tokens[row].append(int(sample(row_probs, request.generator)))
                    probs[row].append(row_probs)
            # One draft position costs its forward plus the per-row sampling around it: record both.
            self.record(used, time.perf_counter() - start)
        for row in rows:
            batch.put(row, tokens[row], torch.cat(probs[row]) if probs[row] else None, self.method)
