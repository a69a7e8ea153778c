"""Medusa heads distilled from the target (``train-draft --kind medusa``): the target frozen, head h learning the
target's own distribution h + 2 places ahead along the target's generations (the dataset train-draft builds).

Head h reads the target's last hidden state at position t and is taught the target's top-k distribution at
position t + h + 1 (the one that predicts token t + h + 2), by the same forward KL on the renormalised top-k as the
draft model (``train.position_terms``); all heads' positions weigh alike. Reported per head on held-out sequences:
greedy agreement and acceptance, sum over the top-k of min(target, head); the bar shows head 0's. The target's
last hidden states come from ``train.StateCache``: computed once per sequence, the heads' steps cost next to
nothing beside the target's forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..medusa_heads import MedusaHeads
from .dataset import DistillSet
from .loop import fit
from .train import HeadRows, StateCache, frequent_ids, padded_batch, position_terms, split


@dataclass(frozen=True)
class MedusaOptions:
    tokens: int  # response positions to train on, counted once per position (all heads learn from each)
    heads: int = 4
    layers: int = 1  # residual blocks per head
    batch_size: int = 4
    lr: float = 1e-3
    warmup_steps: int = 10
    held_out: float = 0.1
    vocab: int | None = None  # heads propose from the N tokens with the most target probability (None: all)
    evals: int = 4
    checkpoint_every: int = 50
    seed: int = 0


def last_states(target, data: DistillSet) -> StateCache:
    """The StateCache of the target's last hidden state, [L, d] float32 per sequence."""
    def compute(ids: torch.Tensor) -> torch.Tensor:
        return target.base_model(input_ids=ids.to(target.device)).last_hidden_state[0].float()

    return StateCache(compute, data)


def _head_terms(heads: MedusaHeads, cache: StateCache, chosen: list[int], device):
    """(mean KL over every head's positions, per head [agreement, acceptance, positions], positions)."""
    input_ids, _, targets = padded_batch(cache.data, chosen, device)
    hidden = cache.batch(chosen, input_ids.shape[1]).to(device)  # [B, L, d]
    rows = HeadRows(heads.vocab_ids, heads.vocab_size)
    kls, per_head, positions = [], [[0.0, 0.0, 0] for _ in heads], 0
    for r, (start, ids_k, logp_k) in enumerate(targets):
        n = ids_k.shape[0]
        positions += n
        for h in range(heads.num_heads):
            m = n - h - 1  # hidden at start - 1 + i is taught row i + h + 1
            if m <= 0:
                continue
            logits = heads.head_logits(h, hidden[r, start - 1:start - 1 + m]).float()  # [m, N]
            kl, agree, accept, _ = position_terms(logits, ids_k[h + 1:h + 1 + m].to(device),
                                                  logp_k[h + 1:h + 1 + m].to(device), rows)
            kls.append(kl)
            per_head[h][0] += agree
            per_head[h][1] += accept
            per_head[h][2] += m
    kl = torch.cat(kls) if kls else torch.zeros(0, device=device)
    loss = kl.mean() if kl.numel() else sum(p.sum() for p in heads.parameters()) * 0.0
    return loss, per_head, positions


@torch.no_grad()
def evaluate_heads(heads: MedusaHeads, target, data: DistillSet, sequences: list[int], batch_size: int = 8,
                   cache: StateCache | None = None) -> dict:
    """Per head, the held-out figures of the module docstring over ``sequences`` (``cache``: the run's StateCache)."""
    heads.eval()
    device = next(heads.parameters()).device
    if cache is None:
        cache = last_states(target, data)
    totals = [[0.0, 0.0, 0] for _ in heads]
    loss, counted = 0.0, 0
    for first in range(0, len(sequences), batch_size):
        kl, per_head, _ = _head_terms(heads, cache, sequences[first:first + batch_size], device)
        n = sum(p[2] for p in per_head)
        loss, counted = loss + float(kl) * n, counted + n
        for total, part in zip(totals, per_head):
            total[0], total[1], total[2] = total[0] + part[0], total[1] + part[1], total[2] + part[2]
    by_head = [{"agreement": a / max(n, 1), "acceptance": c / max(n, 1)} for a, c, n in totals]
    return {"acceptance": by_head[0]["acceptance"], "agreement": by_head[0]["agreement"],
            "loss": loss / max(counted, 1), "by_head": by_head}


def train_medusa(heads: MedusaHeads, target, data: DistillSet, options: MedusaOptions, state_dir: Path | None = None,
                 resume: bool = False, stop_after: int | None = None) -> dict:
    """Train ``heads`` in place over the frozen ``target``; returns the history (see loop.fit)."""
    for p in target.parameters():
        p.requires_grad_(False)
    device = next(heads.parameters()).device
    train_set, held_set = split(data, options.held_out, options.seed)
    if not train_set:
        raise ValueError("train-draft: the dataset has no training sequences; give more prompts or tokens")
    tokens_per_seq = sum(data.sequence(s)[2].shape[0] for s in train_set) / len(train_set)
    if options.vocab is not None:
        heads.vocab_ids = frequent_ids(data, train_set, options.vocab, heads.vocab_size)

    cache = last_states(target, data)

    def step_loss(chosen: list[int]):
        loss, _, positions = _head_terms(heads, cache, chosen, device)
        return loss, positions

    return fit(heads, options, train_set, tokens_per_seq, step_loss,
               lambda: evaluate_heads(heads, target, data, held_set, cache=cache), state_dir=state_dir,
               resume=resume, stop_after=stop_after, desc="train medusa heads")
