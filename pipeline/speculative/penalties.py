"""Penalties, bias and min_tokens on a row's logits at several positions at once, each with its own history.

Under speculation the target judges K+1 positions in one forward; position j follows the tokens generated so far
plus the draft tokens before it, so its counts (presence, frequency, repetition) and its generated length
(min_tokens) include them. Applying one state to every position would give a distribution the plain decoder never
samples from, and rejection sampling is lossless only against the distribution it is given. ``paths[j]`` names the
tokens appended before position j: a chain's draft prefix, or a tree node's ancestors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .sampling_params import LogitsAdjust


def _appended_counts(paths: list[list[int]], vocab: int, device) -> Tensor:
    """[P, V] float: how often each token occurs in each position's path."""
    counts = torch.zeros(len(paths), vocab, device=device)
    rows = [p for p, path in enumerate(paths) for _ in path]
    if rows:
        tokens = torch.tensor([t for path in paths for t in path], device=device)
        counts.index_put_((torch.tensor(rows, device=device), tokens), torch.ones(len(rows), device=device),
                          accumulate=True)
    return counts


def adjust_logits(logits: Tensor, adjust: LogitsAdjust, generated: list[int], prompt: list[int],
                  paths: list[list[int]], stop_ids: list[int]) -> Tensor:
    """logits: [P, V], position p's target logits after ``generated`` + ``paths[p]`` -> adjusted logits [P, V]
    (float32, a new tensor). ``prompt``: the prompt's ids (seen by the repetition penalty only); ``stop_ids``:
    masked at positions where fewer than ``adjust.min_tokens`` tokens precede in the output."""
    # vLLM's order: bias and min_tokens first, then the repetition penalty, then presence and frequency.
    out = logits.float().clone()
    vocab = out.shape[-1]
    device = out.device
    pairs = [(token, bias) for token, bias in adjust.logit_bias if 0 <= token < vocab]  # ids are unique
    if pairs:  # one op, not one per entry: up to 300 entries, at every verified and drafted position
        tokens = torch.tensor([t for t, _ in pairs], device=device)
        out[:, tokens] += torch.tensor([b for _, b in pairs], device=device)
    if adjust.min_tokens and stop_ids:
        lengths = torch.tensor([len(generated) + len(path) for path in paths], device=device)  # [P]
        early = (lengths < adjust.min_tokens)[:, None]  # [P, 1]
        stops = torch.zeros(vocab, dtype=torch.bool, device=device)
        stops[torch.tensor([t for t in stop_ids if 0 <= t < vocab], dtype=torch.long, device=device)] = True
        out = out.masked_fill(early & stops[None, :], float("-inf"))
    if adjust.presence_penalty or adjust.frequency_penalty or adjust.repetition_penalty != 1:
        base = torch.bincount(torch.tensor(generated, dtype=torch.long, device=device), minlength=vocab)[:vocab]
        counts = base.float()[None, :] + _appended_counts(paths, vocab, device)  # [P, V]
        if adjust.repetition_penalty != 1:
            seen = counts > 0
            if prompt:
                seen[:, torch.tensor(prompt, dtype=torch.long, device=device).clamp_max(vocab - 1)] = True
            penalized = torch.where(out > 0, out / adjust.repetition_penalty, out * adjust.repetition_penalty)
            out = torch.where(seen, penalized, out)
        out -= adjust.frequency_penalty * counts + adjust.presence_penalty * (counts > 0).float()
    return out
