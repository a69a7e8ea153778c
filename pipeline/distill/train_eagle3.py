"""EAGLE-3 heads distilled from the frozen target (``train-draft --kind eagle3``), with training-time test.

Per sequence of the dataset (the target's own generations), the target runs once, frozen, and its fused layers'
outputs give the first draft step's hidden state at every position i, paired with token i + 1; the heads predict
token i + 2. Training-time test then runs the later draft steps as drafting runs them: step j reads the previous
step's own output (not the target's) beside token i + 1 + j, at RoPE position i + j, and attends to the first
step's keys up to position i plus its own chain's keys (steps 1..j at position i), exactly the keys a chain drafted
from position i sees. Step j at position i is taught the target's top-k distribution of token i + 2 + j by the
forward KL of ``train.position_terms`` over the draft vocabulary; step j's loss weighs STEP_DECAY ** j.

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
from .train import HeadRows, frequent_ids, padded_batch, position_terms, split

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


def chain_attention(q: Tensor, keys: list[Tensor], values: list[Tensor], scaling: float) -> Tensor:
    """Step len(keys) - 1's attention for every position at once: q [B, T, H, hd] over the first step's keys
    causally and each later step's key at the query's own position. keys/values [B, T, KVH, hd] per step."""
    group = q.shape[-2] // keys[0].shape[-2]
    k0, v0 = (x.repeat_interleave(group, dim=-2) for x in (keys[0], values[0]))
    length = q.shape[1]
    scores = torch.einsum("bthd,bshd->bhts", q, k0) * scaling  # [B, H, T, T]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, -math.inf)
    chain = [(q * k.repeat_interleave(group, dim=-2)).sum(-1).transpose(1, 2) * scaling for k in keys[1:]]  # [B, H, T]
    weights = torch.cat([scores, *[c[..., None] for c in chain]], dim=-1).float().softmax(-1).to(q.dtype)
    out = torch.einsum("bhts,bshd->bthd", weights[..., :length], v0)
    for s, v in enumerate(values[1:]):
        out = out + weights[..., length + s].transpose(1, 2)[..., None] * v.repeat_interleave(group, dim=-2)
    return out


def ttt_steps(heads: Eagle3Heads, input_ids: Tensor, states: Tensor, steps: int):
    """Training-time test over whole sequences: for each draft step j, the heads' normed outputs [B, L - 1, d],
    position i's predicting token i + 2 + j (input_ids [B, L]; states [B, L, layers, d], the target's)."""
    length = input_ids.shape[1] - 1  # pair i: the state after token i, token i + 1
    hidden = heads.fuse(states[:, :length].float())
    positions = torch.arange(length, device=input_ids.device)
    keys, values = [], []
    for j in range(steps):
        tokens = torch.zeros_like(input_ids[:, :length])
        tokens[:, :max(length - j, 0)] = input_ids[:, 1 + j:]
        projected = heads.project(tokens, hidden, positions + j)
        keys.append(projected.k)
        values.append(projected.v)
        normed, hidden = heads.finish(chain_attention(projected.q, keys, values, heads.scaling), projected.residual)
        yield normed


def _ttt_terms(heads: Eagle3Heads, target, data: DistillSet, chosen: list[int], steps: int, device):
    """(weighted mean KL, per step [agreement, acceptance, coverage, positions], positions)."""
    input_ids, mask, targets = padded_batch(data, chosen, device)
    with torch.no_grad():
        states = target_states(target, heads.config.target_layers, input_ids, mask)
    length = input_ids.shape[1] - 1
    rows = head_rows(heads)
    losses, per_step, positions_n = [], [], 0
    for j, normed in enumerate(ttt_steps(heads, input_ids, states, steps)):
        kls, totals = [], [0.0, 0.0, 0.0, 0]
        for r, (start, ids_k, logp_k) in enumerate(targets):
            # Position i predicts token i + 2 + j, the dataset's row i + 2 + j - start.
            first = max(start - 2 - j, 0)
            last = min(start - 2 - j + ids_k.shape[0], length)
            if last <= first:
                continue
            rows_at = slice(first + 2 + j - start, last + 2 + j - start)
            logits = heads.logits(normed[r, first:last]).float()
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
                   batch_size: int = 8) -> dict:
    heads.eval()
    device = heads.fc.weight.device
    totals = [[0.0, 0.0, 0.0, 0] for _ in range(steps)]
    loss, counted = 0.0, 0
    for first in range(0, len(sequences), batch_size):
        kl, per_step, n = _ttt_terms(heads, target, data, sequences[first:first + batch_size], steps, device)
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

    def step_loss(chosen: list[int]):
        loss, _, positions = _ttt_terms(heads, target, data, chosen, options.ttt_steps, device)
        return loss, positions

    return fit(heads, options, train_set, tokens_per_seq, step_loss,
               lambda: evaluate_heads(heads, target, data, held_set, options.ttt_steps), state_dir=state_dir,
               resume=resume, stop_after=stop_after, desc="train eagle3 heads")


def draft_vocab(data: DistillSet, vocab: int | None, vocab_size: int, options: Eagle3Options) -> list[int] | None:
    """The draft vocabulary: the ``vocab`` ids with the most target probability on the training sequences."""
    if vocab is None or vocab >= vocab_size:
        return None
    train_set, _ = split(data, options.held_out, options.seed)
    return frequent_ids(data, train_set, vocab, vocab_size)
