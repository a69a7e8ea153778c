"""EAGLE-3 heads distilled from the frozen target (``train-draft --kind eagle3``), with training-time test.

Per sequence of the dataset (the target's own generations), the target runs once, frozen, and its fused layers'
outputs give the first draft step's hidden state at every position i, paired with token i + 1; the heads predict
token i + 2. Training-time test then runs the later draft steps as drafting runs them: step j reads the previous
step's own output (not the target's) beside token i + 1 + j, at RoPE position i + j, and attends to the first
step's keys up to position i plus its own chain's keys (steps 1..j at position i), exactly the keys a chain drafted
from position i sees. Step j at position i is taught the target's top-k distribution of token i + 2 + j by the
forward KL of ``train.position_terms`` over the draft vocabulary; step j's loss weighs STEP_DECAY ** j.

The target's states come from ``train.StateCache`` (each sequence's computed once, alone): batches draw each
sequence several times, and the frozen target's forward costs more than the heads' own step. The heads run the
draft steps only from the first position whose prediction is trained (a sequence's prompt positions still give the
first step's keys): a chat's prompt is most of its length.

Reported per draft position on held-out sequences: greedy agreement and acceptance (sum over the top-k of
min(target, draft)), each given the earlier tokens right; ``accepted_per_step`` estimates a greedy chain's accepted
tokens, sum over j of the product of the agreements up to j.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..eagle3_heads import Eagle3Heads
from .dataset import DistillSet
from .loop import fit
from .train import HeadRows, StateCache, frequent_ids, padded_batch, position_terms, split

STEP_DECAY = 0.8


@dataclass(frozen=True)
class Eagle3Options:
    tokens: int  # response positions to train on (every draft step learns from each)
    ttt_steps: int = 5  # draft steps unrolled per position (training-time test)
    batch_size: int = 4
    lr: float = 1e-3
    warmup_steps: int = 10
    held_out: float = 0.1
    vocab: int | None = None  # the draft vocabulary: the N target tokens with the most target probability
    evals: int = 4
    checkpoint_every: int = 50
    seed: int = 0


def head_rows(heads: Eagle3Heads) -> HeadRows:
    c = heads.config
    if c.draft_vocab_size == c.vocab_size:
        return HeadRows(None, c.vocab_size)
    return HeadRows(heads.target_ids(torch.arange(c.draft_vocab_size, device=heads.d2t.device)).tolist(),
                    c.vocab_size)


def target_states(target, layers: tuple[int, ...], input_ids: Tensor, mask: Tensor) -> Tensor:
    """The target's outputs after ``layers`` [B, L, len(layers), d] (hidden_states[i + 1] is layer i's)."""
    out = target.base_model(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
    return torch.stack([out.hidden_states[layer + 1] for layer in layers], dim=-2)


def fused_states(target, layers: tuple[int, ...], data: DistillSet) -> StateCache:
    """The StateCache of the target's outputs after ``layers``, [L, len(layers), d] per sequence."""
    def compute(ids: Tensor) -> Tensor:
        ids = ids.to(target.device)
        return target_states(target, tuple(layers), ids, torch.ones_like(ids))[0]

    return StateCache(compute, data)


def chain_attention(q: Tensor, keys: list[Tensor], values: list[Tensor], scaling: float, first: int = 0) -> Tensor:
    """Step len(keys) - 1's attention for the positions from ``first`` on at once: q [B, T, H, hd] over the first
    step's keys [B, first + T, KVH, hd] causally and each later step's key at the query's own position (keys/values
    of the later steps [B, T, KVH, hd])."""
    group = q.shape[-2] // keys[0].shape[-2]
    k0, v0 = (x.repeat_interleave(group, dim=-2) for x in (keys[0], values[0]))
    length = k0.shape[1]
    scores = torch.einsum("bthd,bshd->bhts", q, k0) * scaling  # [B, H, T, first + T]
    causal = torch.ones(q.shape[1], length, dtype=torch.bool, device=q.device).tril(diagonal=first)
    scores = scores.masked_fill(~causal, -math.inf)
    chain = [(q * k.repeat_interleave(group, dim=-2)).sum(-1).transpose(1, 2) * scaling for k in keys[1:]]  # [B, H, T]
    weights = torch.cat([scores, *[c[..., None] for c in chain]], dim=-1).float().softmax(-1).to(q.dtype)
    out = torch.einsum("bhts,bshd->bthd", weights[..., :length], v0)
    for s, v in enumerate(values[1:]):
        out = out + weights[..., length + s].transpose(1, 2)[..., None] * v.repeat_interleave(group, dim=-2)
    return out


def ttt_steps(heads: Eagle3Heads, input_ids: Tensor, states: Tensor, steps: int, first: int = 0):
    """Training-time test over whole sequences: for each draft step j, the heads' normed outputs [B, L - 1 - first,
    d] of the positions from ``first`` on, position i's predicting token i + 2 + j (input_ids [B, L]; states [B, L,
    layers, d], the target's). The positions before ``first`` only give the first step's keys."""
    length = input_ids.shape[1] - 1  # pair i: the state after token i, token i + 1
    hidden = heads.fuse(states[:, :length].float())
    positions = torch.arange(length, device=input_ids.device)
    keys, values = [], []
    for j in range(steps):
        tokens = torch.zeros_like(input_ids[:, :length])
        tokens[:, :max(length - j, 0)] = input_ids[:, 1 + j:]
        if j == 0:  # every position's keys; queries from ``first`` on
            projected = heads.project(tokens, hidden, positions)
            q, residual = projected.q[:, first:], projected.residual[:, first:]
        else:
            projected = heads.project(tokens[:, first:], hidden, positions[first:] + j)
            q, residual = projected.q, projected.residual
        keys.append(projected.k)
        values.append(projected.v)
        normed, hidden = heads.finish(chain_attention(q, keys, values, heads.scaling, first), residual)
        yield normed


def _first_trained(starts: list[int], steps: int) -> int:
    """The first position any draft step trains in sequences whose responses start at ``starts``: step j at
    position i predicts token i + 2 + j."""
    return max(min(starts) - 1 - steps, 0)


def _ttt_terms(heads: Eagle3Heads, cache: StateCache, chosen: list[int], steps: int, device):
    """(weighted mean KL, per step [agreement, acceptance, coverage, positions], positions)."""
    input_ids, _, targets = padded_batch(cache.data, chosen, device)
    states = cache.batch(chosen, input_ids.shape[1]).to(device)
    length = input_ids.shape[1] - 1
    lowest = _first_trained([start for start, _, _ in targets], steps)
    rows = head_rows(heads)
    losses, per_step, positions_n = [], [], 0
    for j, normed in enumerate(ttt_steps(heads, input_ids, states, steps, lowest)):
        kls, totals = [], [0.0, 0.0, 0.0, 0]
        for r, (start, ids_k, logp_k) in enumerate(targets):
            # Position i predicts token i + 2 + j, the dataset's row i + 2 + j - start.
            first = max(start - 2 - j, 0)
            last = min(start - 2 - j + ids_k.shape[0], length)
            if last <= first:
                continue
            rows_at = slice(first + 2 + j - start, last + 2 + j - start)
            logits = heads.logits(normed[r, first - lowest:last - lowest]).float()
            kl, agree, accept, covered = position_terms(logits, ids_k[rows_at].to(device),
                                                        logp_k[rows_at].to(device), rows)
            kls.append(kl)
            totals = [totals[0] + agree, totals[1] + accept, totals[2] + covered, totals[3] + last - first]
        if kls and torch.cat(kls).numel():
            losses.append(STEP_DECAY ** j * torch.cat(kls).mean())
        per_step.append(totals)
        positions_n += totals[3] if j == 0 else 0
    loss = sum(losses) / sum(STEP_DECAY ** j for j in range(steps)) if losses else \
        sum(p.sum() for p in heads.parameters()) * 0.0
    return loss, per_step, positions_n


@torch.no_grad()
def evaluate_heads(heads: Eagle3Heads, target, data: DistillSet, sequences: list[int], steps: int,
                   batch_size: int = 8, cache: StateCache | None = None) -> dict:
    """The held-out figures of the module docstring over ``sequences`` (``cache``: the run's StateCache)."""
    heads.eval()
    device = heads.fc.weight.device
    if cache is None:
        cache = fused_states(target, heads.config.target_layers, data)
    totals = [[0.0, 0.0, 0.0, 0] for _ in range(steps)]
    loss, counted = 0.0, 0
    for first in range(0, len(sequences), batch_size):
        kl, per_step, n = _ttt_terms(heads, cache, sequences[first:first + batch_size], steps, device)
        loss, counted = loss + float(kl) * n, counted + n
        totals = [[a + b for a, b in zip(total, part)] for total, part in zip(totals, per_step)]
    by_position = [{"agreement": a / max(n, 1), "acceptance": c / max(n, 1)} for a, c, _, n in totals]
    chain, run = 0.0, 1.0
    for position in by_position:
        run *= position["agreement"]
        chain += run
    return {"acceptance": by_position[0]["acceptance"], "agreement": by_position[0]["agreement"],
            "loss": loss / max(counted, 1), "coverage": totals[0][2] / max(totals[0][3], 1),
            "by_position": by_position, "accepted_per_step": round(chain, 3)}


def train_eagle3(heads: Eagle3Heads, target, data: DistillSet, options: Eagle3Options,
                 state_dir: Path | None = None, resume: bool = False, stop_after: int | None = None) -> dict:
    """Train ``heads`` in place over the frozen ``target``; returns the history (see loop.fit)."""
    for p in target.parameters():
        p.requires_grad_(False)
    device = heads.fc.weight.device
    train_set, held_set = split(data, options.held_out, options.seed)
    if not train_set:
        raise ValueError("train-draft: the dataset has no training sequences; give more prompts or tokens")
    tokens_per_seq = sum(data.sequence(s)[2].shape[0] for s in train_set) / len(train_set)
    cache = fused_states(target, heads.config.target_layers, data)

    def step_loss(chosen: list[int]):
        loss, _, positions = _ttt_terms(heads, cache, chosen, options.ttt_steps, device)
        return loss, positions

    return fit(heads, options, train_set, tokens_per_seq, step_loss,
               lambda: evaluate_heads(heads, target, data, held_set, options.ttt_steps, cache=cache),
               state_dir=state_dir, resume=resume, stop_after=stop_after, desc="train eagle3 heads")


def draft_vocab(data: DistillSet, vocab: int | None, vocab_size: int, options: Eagle3Options) -> list[int] | None:
    """The draft vocabulary: the ``vocab`` ids with the most target probability on the training sequences."""
    if vocab is None or vocab >= vocab_size:
        return None
    train_set, _ = split(data, options.held_out, options.seed)
    return frequent_ids(data, train_set, vocab, vocab_size)
