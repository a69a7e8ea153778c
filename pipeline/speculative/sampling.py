"""Sampling controls, applied identically to the draft and the target before acceptance.

Rejection sampling is lossless with respect to whatever distribution both sides use, so temperature, top-k and
top-p must transform the draft's and the target's logits the same way; the result is then exactly the target's
temperature/top-k/top-p distribution.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .sampling_params import SamplingParams


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """logits: [..., V] -> probabilities [..., V] (float32) after temperature, top-k and top-p.

    Greedy params give a one-hot distribution on the argmax, so callers can treat both modes alike.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # Any temperature > 0 is valid, however small. With the row's max subtracted first the quotient is never
    # positive, so it cannot overflow to +inf (which made inf - inf = NaN in the softmax); and a temperature below
    # float32's smallest normal divides as that normal (a Python 1e-46 would be 0 in float32). For tiny
    # temperatures every other logit goes to -inf: all mass on the argmax, split evenly on exact ties, which is
    # the limit distribution as the temperature goes to 0.
    temperature = max(params.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Drop a token when the tokens ranked above it already reach top_p; the top token always stays.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """probs: [N, V] -> one token per row [N] (long). Raises ValueError for a row that is not a distribution
    (NaN, inf, negative, or no mass): on a GPU torch.multinomial would stop the whole device with an assert."""
    mass = probs.sum(-1)  # [N]
    valid = (probs >= 0).all(-1) & torch.isfinite(mass) & (mass > 0)  # [N]
    if not bool(valid.all()):
        row = int((~valid).nonzero()[0, 0])
        raise ValueError(f"probs: row {row} is not a probability distribution (total {float(mass[row])}, NaN, inf "
                         f"or negative entries); the logits it came from were not finite")
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """probs: [N, V], uniforms: [N] in [0, 1) -> one token per row [N] (long): the token whose cumulative
    probability interval holds the uniform, so a caller that draws the uniforms itself (one stream per request)
    samples a whole batch in one call. Tokens of probability 0 are never chosen."""
    cdf = probs.float().cumsum(-1)  # [N, V]
    target = uniforms.float()[:, None] * cdf[:, -1:]  # [N, 1]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [N]
    # Rounding can put the target at the very top: take the last token that has probability.
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).long().argmax(-1)  # [N]
    return torch.minimum(tokens, last)
