"""N-gram (prompt-lookup) proposals: draft tokens copied from earlier in the sequence, at no model cost.

When the text being generated repeats its context (code edits, extraction, JSON with repeated keys, quotes), the
tokens that followed the previous occurrence of the current suffix are a good guess for what comes next. Used as
draft tokens they are verified by the target like any other proposal; as a distribution they are one-hot, so the
accept rule keeps a proposed token x with probability target(x) and otherwise samples the target with x removed,
which keeps the target's distribution exactly (as TensorRT-LLM's and vLLM's n-gram paths do).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def propose_ngram(tokens: Sequence[int], k: int, min_match: int = 1, max_match: int = 4) -> list[int]:
    """Up to ``k`` tokens that followed an earlier occurrence of the sequence's longest recurring suffix.

    The longest match (up to ``max_match`` tokens) wins, since a longer match predicts better; among equally long
    matches, one followed by a full ``k`` tokens beats one that runs into the end of the sequence (a short proposal
    wastes the verify's width), and then the most recent wins (nearby context predicts best). Returns [] when no
    suffix of at least ``min_match`` tokens recurs.
    """
    n = len(tokens)
    if k <= 0 or n < 2:
        return []
    seq = list(tokens)
    last = seq[-1]
    best, best_end = (0, 0), -1  # (match length, proposal length), compared in that order
    # Candidates end where the last token recurs; scanned most recent first, so ties keep the most recent. One pass
    # of integer compares: cheap even for long prompts.
    for end in range(n - 2, -1, -1):
        if seq[end] != last:
            continue
        size = 1
        while size < max_match and end - size >= 0 and seq[end - size] == seq[n - 1 - size]:
            size += 1
        score = (size, min(n - 1 - end, k))
        if score > best:
            best, best_end = score, end
            if score == (max_match, k):
                break
    if best[0] < min_match:
        return []
    return seq[best_end + 1:best_end + 1 + k]


def one_hot_probs(tokens: Sequence[int], vocab: int, device=None) -> Tensor:
    """The draft distribution of deterministic proposals: [len(tokens), vocab], one-hot rows."""
    probs = torch.zeros(len(tokens), vocab, device=device)
    if tokens:
        probs[torch.arange(len(tokens)), torch.tensor(list(tokens), device=device)] = 1.0
    return probs
