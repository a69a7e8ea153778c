"""Distil the draft toward the target: forward KL on the target's top-k distributions along its own generations.

Loss per predicted position: KL(target || draft) over the target's top-k tokens, the target's top-k probabilities
renormalised to sum to 1 and the draft's log-probabilities taken over its whole vocabulary (so mass the draft puts
outside the target's top-k is penalised through the normalisation). Forward KL rather than total variation: TV
(1 - the acceptance rate) has a zero gradient wherever the draft already exceeds the target, which on a draft that
starts as a slice of the target is most of the vocabulary; the KL's gradient pulls every token toward the target's
probability. What is reported is what speculation gets: on held-out sequences, the greedy agreement (the draft's
top token is the target's) and the sampled acceptance sum_x min(target(x), draft(x)) over the target's top-k.

With ``vocab`` set, the draft's head is trained over the ``vocab`` target tokens with the most target probability
along the training sequences (pipeline/draft_vocab.py): the loss, the normalisation and the acceptance are all taken
over those tokens (the target's probability outside them counts as mass the draft cannot accept), and the ids are
written to the draft's config so the executor computes only those logits.

The loop itself (seeded batches, schedule, evaluations, resumable checkpoints) is ``loop.fit``. The heads' trainers
(Medusa, EAGLE-3) read the frozen target's states along each sequence through ``StateCache``: computed once per
sequence and kept, since batches draw each sequence several times.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .dataset import DistillSet
from .loop import fit


@dataclass(frozen=True)
class TrainOptions:
    tokens: int  # response tokens to train on (several passes over the dataset when it is smaller)
    batch_size: int = 4  # sequences per step
    lr: float = 3e-4
    warmup_steps: int = 10
    held_out: float = 0.1  # share of the sequences kept for evaluation
    evals: int = 4  # evaluations over the run (after each quarter by default)
    checkpoint_every: int = 50  # steps
    seed: int = 0
    vocab: int | None = None  # target tokens the draft's head covers (None: all of them)


@dataclass
class EvalResult:
    agreement: float  # the draft's top token is the target's, per held-out position
    acceptance: float  # sum over the target's top-k of min(target, draft) (sampling at temperature 1)
    loss: float
    coverage: float = 1.0  # share of the target's top-k probability on tokens the draft's head covers


def frequent_ids(data: DistillSet, sequences: list[int], size: int, vocab_size: int) -> list[int]:
    """The ``size`` of ``vocab_size`` target ids with the most target probability over the response positions of
    ``sequences`` (ascending; ties go to the lower id)."""
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    for s in sequences:
        _, _, ids_k, logp_k = data.sequence(s)
        mass.index_add_(0, ids_k.flatten(), logp_k.exp().flatten().double())
    heaviest = torch.sort(-mass, stable=True).indices[:size]  # stable: among equal masses the lower id first
    return sorted(heaviest.tolist())


class HeadRows:
    """Which head rows the draft is trained on: all (``ids`` None) or a reduced vocabulary, and where each target
    id sits among them."""

    def __init__(self, ids: list[int] | None, vocab_size: int):
        self.ids = None if ids is None else torch.tensor(ids, dtype=torch.long)
        self.row_of = None
        if ids is not None:
            self.row_of = torch.full((vocab_size,), -1, dtype=torch.long)  # [V] target id -> head row, -1 outside
            self.row_of[self.ids] = torch.arange(len(ids))

    def logits(self, model, input_ids, mask):
        """[B, L, N] logits over the covered rows (N = V without a reduced vocabulary)."""
        if self.ids is None:
            return model(input_ids=input_ids, attention_mask=mask).logits.float()
        hidden = model.base_model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        head = model.get_output_embeddings()
        ids = self.ids.to(hidden.device)
        bias = None if getattr(head, "bias", None) is None else head.bias[ids]
        return torch.nn.functional.linear(hidden, head.weight[ids], bias).float()

    def rows(self, target_ids):
        """Head row of each target id (-1 outside the reduced vocabulary)."""
        return target_ids if self.row_of is None else self.row_of.to(target_ids.device)[target_ids]

    def target_id(self, rows):
        return rows if self.ids is None else self.ids.to(rows.device)[rows]


# The frozen target's states kept for reuse by StateCache. EAGLE-3's fused states of SmolLM2-135M's chats in the
# shipped recipe take about 0.9 GB (float32, 3 layers x 576 per token); past the budget a sequence's states are
# computed again at every use.
STATE_CACHE_BYTES = 3 << 30


class StateCache:
    """What ``compute(ids [1, L]) -> [L, ...]`` gives for each sequence of ``data`` (the frozen target's states along
    it), computed for the sequence alone, so its numbers do not depend on which sequences share a batch or on where
    a resumed run restarted, and kept while the kept ones fit ``budget`` bytes: batches draw each sequence several
    times, and the target's forward costs more than a head's step."""

    def __init__(self, compute, data: DistillSet, budget: int = STATE_CACHE_BYTES):
        self.compute, self.data, self.budget = compute, data, budget
        self.kept: dict[int, torch.Tensor] = {}
        self.bytes = 0

    @torch.no_grad()
    def of(self, sequence: int) -> torch.Tensor:
        """The states of sequence ``sequence`` (its L tokens), in host memory (a GPU target's memory is the
        model's)."""
        if sequence in self.kept:
            return self.kept[sequence]
        states = self.compute(self.data.sequence(sequence)[0][None]).cpu()
        size = states.numel() * states.element_size()
        if self.bytes + size <= self.budget:
            self.kept[sequence] = states
            self.bytes += size
        return states

    def batch(self, chosen: list[int], width: int) -> torch.Tensor:
        """[B, width, ...] on the CPU: the sequences' states, right-padded with zeros (only the padding's own
        positions could read them, and nothing is trained there)."""
        rows = [self.of(s) for s in chosen]
        out = rows[0].new_zeros(len(rows), width, *rows[0].shape[1:])
        for r, states in enumerate(rows):
            out[r, :states.shape[0]] = states
        return out


def split(data: DistillSet, held_out: float, seed: int) -> tuple[list[int], list[int]]:
    order = torch.randperm(data.sequences, generator=torch.Generator().manual_seed(seed)).tolist()
    cut = max(1, round(len(order) * held_out)) if len(order) > 1 else 0
    return order[cut:], order[:cut]


def padded_batch(data: DistillSet, chosen: list[int], device):
    """Right-padded ids [B, L], attention mask [B, L], and per row (positions predicting its response, top-k)."""
    rows = [data.sequence(s) for s in chosen]
    width = max(len(ids) for ids, _, _, _ in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (ids, _, _, _) in enumerate(rows):
        input_ids[r, :len(ids)] = ids
        mask[r, :len(ids)] = 1
    return input_ids.to(device), mask.to(device), [(start, ids_k, logp_k) for _, start, ids_k, logp_k in rows]


def position_terms(logits, ids_k, logp_k, head: HeadRows):
    """For n positions: the draft's logits [n, N] against the target's top-k ids and log-probs [n, k] ->
    (KL per position that teaches something [m], agreement count, acceptance sum, covered-share sum)."""
    draft_logp = torch.log_softmax(logits, dim=-1)  # [n, N]
    rows = head.rows(ids_k)  # [n, k]
    inside = rows >= 0
    draft_at = draft_logp.gather(-1, rows.clamp_min(0)).masked_fill(~inside, float("-inf"))  # [n, k]
    # The target's top-k renormalised over the tokens the draft can propose; a position where it can propose none
    # of them teaches nothing.
    target_p = torch.softmax(logp_k.masked_fill(~inside, float("-inf")), dim=-1).nan_to_num(0.0)  # [n, k]
    terms = torch.where(inside, target_p * (torch.log(target_p.clamp_min(1e-12)) - draft_at), 0.0)
    with torch.no_grad():
        agree = float((head.target_id(draft_logp.argmax(-1)) == ids_k[:, 0]).sum())
        accept = float(torch.minimum(logp_k.exp(), draft_at.exp()).sum())
        top = logp_k.exp()
        covered = float((top.masked_fill(~inside, 0.0).sum(-1) / top.sum(-1)).sum())
    return terms.sum(-1)[inside.any(-1)], agree, accept, covered


def _loss_terms(model, data: DistillSet, chosen: list[int], device, head: HeadRows):
    """(mean KL, agreement count, acceptance sum, covered-share sum, positions) over the response positions of
    ``chosen``."""
    input_ids, mask, targets = padded_batch(data, chosen, device)
    logits = head.logits(model, input_ids, mask)  # [B, L, N]
    kls, agree, accept, covered, positions = [], 0.0, 0.0, 0.0, 0
    for r, (start, ids_k, logp_k) in enumerate(targets):
        n = ids_k.shape[0]
        kl, a, c, m = position_terms(logits[r, start - 1:start - 1 + n], ids_k.to(device), logp_k.to(device), head)
        kls.append(kl)
        agree, accept, covered, positions = agree + a, accept + c, covered + m, positions + n
    kl = torch.cat(kls)
    return (kl.mean() if kl.numel() else logits.sum() * 0.0), agree, accept, covered, positions


@torch.no_grad()
def evaluate(model, data: DistillSet, sequences: list[int], batch_size: int = 8,
             head: HeadRows | None = None) -> EvalResult:
    model.eval()
    device = next(model.parameters()).device
    head = head or HeadRows(None, 0)
    agree = accept = covered = loss = 0.0
    positions = 0
    for first in range(0, len(sequences), batch_size):
        kl, a, c, m, n = _loss_terms(model, data, sequences[first:first + batch_size], device, head)
        agree, accept, covered = agree + a, accept + c, covered + m
        loss, positions = loss + float(kl) * n, positions + n
    n = max(positions, 1)
    return EvalResult(agree / n, accept / n, loss / n, covered / n)


def train_draft(draft, data: DistillSet, options: TrainOptions, state_dir: Path | None = None,
                resume: bool = False, stop_after: int | None = None) -> dict:
    """Train ``draft`` in place; returns the history (evaluations, tokens/s). ``state_dir`` keeps checkpoints for
    ``resume``; ``stop_after`` ends the run after that many steps of this call (as a kill would, for tests).
    With ``options.vocab`` the draft's config gets its ``draft_vocab`` (pipeline/draft_vocab.py)."""
    from ..draft_vocab import CONFIG_KEY

    device = next(draft.parameters()).device
    train_set, held_set = split(data, options.held_out, options.seed)
    if not train_set:
        raise ValueError("train-draft: the dataset has no training sequences; give more prompts or tokens")
    vocab_size = draft.get_output_embeddings().weight.shape[0]
    ids = None
    if options.vocab is not None:
        if not 1 <= options.vocab <= vocab_size:
            raise ValueError(f"--vocab: {options.vocab} must be between 1 and the target's {vocab_size} tokens")
        ids = frequent_ids(data, train_set, options.vocab, vocab_size)
        setattr(draft.config, CONFIG_KEY, ids)
    head = HeadRows(ids, vocab_size)
    tokens_per_seq = sum(data.sequence(s)[2].shape[0] for s in train_set) / len(train_set)

    def step_loss(chosen: list[int]):
        loss, _, _, _, positions = _loss_terms(draft, data, chosen, device, head)
        return loss, positions

    return fit(draft, options, train_set, tokens_per_seq, step_loss,
               lambda: asdict(evaluate(draft, data, held_set, head=head)), state_dir=state_dir, resume=resume,
               stop_after=stop_after, desc="train draft")
