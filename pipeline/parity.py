"""Greedy parity with a margin rule: where greedy speculative output differs from greedy target-only output,
is it a near tie that 16-bit rounding can flip, or a real bug?

Greedy speculative decoding reproduces target-only greedy decoding token for token when both compute the same
logits (float32). In 16-bit types it may not, for a reason that is not a bug: the verify pass runs K+1 tokens
through the model at once while plain decoding runs one, so every layer rounds differently, and where the target's
best tokens are nearly tied the argmax can flip. So where outputs diverge, the first differing position and how far
below the target's best logit each emitted token is there (one target-only step on the common prefix) tell the two
apart; in bf16 three tokens can even share the top logit exactly.

Threshold (MARGIN_THRESHOLD, override with SMOKE_MARGIN): 0.5 logits. bf16 keeps 8 significant bits, so a logit
near 16-32 is stored in steps of 0.125; the two paths differ by a few such steps after dozens of layers, and a
top-2 gap of up to 4 steps (0.5) can flip from rounding alone. A flip across a wider gap means the target did not
keep its own argmax: a real bug in the draft-and-verify loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MARGIN_THRESHOLD = float(os.environ.get("SMOKE_MARGIN", "0.5"))


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, the shorter length if one is a prefix of the other, None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2(logits) -> tuple[int, int, float]:
    """(best token, second token, best - second) of one row of logits."""
    values, ids = logits.float().topk(2)
    return int(ids[0]), int(ids[1]), float(values[0] - values[1])


@dataclass(frozen=True)
class Divergence:
    position: int  # first generated token that differs
    plain: int | None  # target-only token there (None: that output ended)
    spec: int | None  # speculative token there
    best: int  # the target's two best tokens after the common prefix, and their logit gap
    second: int
    margin: float
    gap: float = float("inf")  # how far below the target's best logit the lower of the two emitted tokens is

    @property
    def near_tie(self) -> bool:
        """Both emitted tokens are within bf16 rounding of the target's best logit (see MARGIN_THRESHOLD): its top two
        across a small margin, or any of three or more tokens tied at the top."""
        return self.gap <= MARGIN_THRESHOLD

    def describe(self) -> str:
        case = ("near-tie flip (bf16 numerics, tolerated)" if self.near_tie
                else "CLEAR divergence (the target did not keep its own argmax)")
        return (f"first difference at generated token {self.position}: target-only {self.plain}, speculative "
                f"{self.spec}; target top-2 there {self.best}/{self.second}, margin {self.margin:.4f} logits "
                f"(threshold {MARGIN_THRESHOLD}): {case}")


def divergence(prompt_ids: list[int], plain: list[int], spec: list[int], next_logits) -> Divergence | None:
    """``next_logits(ids) -> [vocab]``: the target's logits for the token after ``ids``."""
    i = first_divergence(plain, spec)
    if i is None:
        return None
    logits = next_logits(prompt_ids + plain[:i]).float()  # [vocab]
    best, second, margin = top2(logits)
    at = lambda tokens: tokens[i] if i < len(tokens) else None  # noqa: E731
    picks = [token for token in (at(plain), at(spec)) if token is not None]
    gap = max(float(logits.max() - logits[token]) for token in picks) if len(picks) == 2 else float("inf")
    return Divergence(i, at(plain), at(spec), best, second, margin, gap)
