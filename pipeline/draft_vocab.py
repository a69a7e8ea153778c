"""A draft whose LM head covers part of the target's vocabulary (the tokens the target writes most).

The head of a small draft is most of its cost (SmolLM2-135M: 49152 x 576 of a 4-layer draft's weights), and most
of those rows are tokens the target rarely writes. A draft trained by ``train-draft --vocab N`` records, in its
config.json under ``draft_vocab``, the N target token ids its head is trained for (ascending). Its weights stay a
whole, ordinary checkpoint (every backend loads it); the torch executor then computes only those N logits and
places them at their target ids, with -inf everywhere else. That is lossless: a token outside the set has draft
probability 0, so the draft never proposes it, and rejection sampling's residual max(p - q, 0) gives the target
its whole probability there.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

CONFIG_KEY = "draft_vocab"


def vocab_ids(model) -> list[int] | None:
    """The target ids a reduced-vocabulary draft's head covers (its config's ``draft_vocab``), or None."""
    ids = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    return list(ids) if ids else None


def check_ids(ids, vocab_size: int) -> str | None:
    """Why ``ids`` is not a valid ``draft_vocab`` for a head of ``vocab_size`` rows, or None."""
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return "must be a list of token ids"
    if not ids:
        return "is empty"
    if ids != sorted(set(ids)):
        return "must be ascending without repeats"
    if ids[0] < 0 or ids[-1] >= vocab_size:
        return f"holds ids outside the model's {vocab_size} embedding rows (lowest {ids[0]}, highest {ids[-1]})"
    return None


class ReducedVocabHead(nn.Module):
    """The rows ``ids`` of an LM head; forward gives logits over the whole vocabulary, -inf outside ``ids``."""

    def __init__(self, head: nn.Module, ids: list[int], vocab_size: int):
        super().__init__()
        index = torch.tensor(ids, dtype=torch.long, device=head.weight.device)
        # A contiguous copy: slicing the shared (often tied) weight on every call would cost a gather per forward.
        self.weight = nn.Parameter(head.weight.detach()[index].clone(), requires_grad=False)  # [N, d]
        bias = getattr(head, "bias", None)
        self.bias = None if bias is None else nn.Parameter(bias.detach()[index].clone(), requires_grad=False)
        self.register_buffer("ids", index, persistent=False)  # [N] target id of each row
        self.vocab_size = vocab_size

    def forward(self, hidden: Tensor) -> Tensor:  # [..., d] -> [..., V]
        reduced = nn.functional.linear(hidden, self.weight, self.bias)  # [..., N]
        full = reduced.new_full((*reduced.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.ids, reduced)


def reduce_head(model) -> None:
    """Give a draft whose config names ``draft_vocab`` its reduced head (in place; a no-op for any other model)."""
    ids = vocab_ids(model)
    head = model.get_output_embeddings()
    if ids is None or isinstance(head, ReducedVocabHead):
        return
    problem = check_ids(ids, head.weight.shape[0])
    if problem:
        raise ValueError(f"{CONFIG_KEY} in the draft's config.json {problem}; retrain it with train-draft --vocab")
    model.set_output_embeddings(ReducedVocabHead(head, ids, head.weight.shape[0]))


def logit_width(model) -> int:
    """How many logits the model's forward returns per position (its whole vocabulary, reduced head or not)."""
    head = model.get_output_embeddings()
    return head.vocab_size if isinstance(head, ReducedVocabHead) else head.weight.shape[0]
