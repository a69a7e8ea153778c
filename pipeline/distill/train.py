"""Distil the draft toward the target: forward KL on the target's top-k distributions along its own generations.

Loss per predicted position: KL(target || draft) over the target's top-k tokens, the target's top-k probabilities
renormalised to sum to 1 and the draft's log-probabilities taken over its whole vocabulary (so mass the draft puts
outside the target's top-k is penalised through the normalisation). Forward KL rather than total variation: TV
(1 - the acceptance rate) has a zero gradient wherever the draft already exceeds the target, which on a draft that
starts as a slice of the target is most of the vocabulary; the KL's gradient pulls every token toward the target's
probability. What is reported is what speculation gets: on held-out sequences, the greedy agreement (the draft's
top token is the target's) and the sampled acceptance sum_x min(target(x), draft(x)) over the target's top-k.

Deterministic for a seed: batches come from one seeded generator, whose state is checkpointed with the model, the
optimiser and the step, so ``resume`` continues exactly where a killed run stopped.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .dataset import DistillSet

STATE_FILE = "train_state.pt"


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


@dataclass
class EvalResult:
    agreement: float  # the draft's top token is the target's, per held-out position
    acceptance: float  # sum over the target's top-k of min(target, draft) (sampling at temperature 1)
    loss: float


def split(data: DistillSet, held_out: float, seed: int) -> tuple[list[int], list[int]]:
    order = torch.randperm(data.sequences, generator=torch.Generator().manual_seed(seed)).tolist()
    cut = max(1, round(len(order) * held_out)) if len(order) > 1 else 0
    return order[cut:], order[:cut]


def _batch(data: DistillSet, chosen: list[int], device):
    """Right-padded ids [B, L], attention mask [B, L], and per row (positions predicting its response, top-k)."""
    rows = [data.sequence(s) for s in chosen]
    width = max(len(ids) for ids, _, _, _ in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (ids, _, _, _) in enumerate(rows):
        input_ids[r, :len(ids)] = ids
        mask[r, :len(ids)] = 1
    return input_ids.to(device), mask.to(device), [(start, ids_k, logp_k) for _, start, ids_k, logp_k in rows]


def _loss_terms(model, data: DistillSet, chosen: list[int], device):
    """(mean KL, agreement count, acceptance sum, positions) over the response positions of ``chosen``."""
    input_ids, mask, targets = _batch(data, chosen, device)
    logits = model(input_ids=input_ids, attention_mask=mask).logits.float()  # [B, L, V]
    kls, agree, accept, positions = [], 0.0, 0.0, 0
    for r, (start, ids_k, logp_k) in enumerate(targets):
        n = ids_k.shape[0]
        draft_logp = torch.log_softmax(logits[r, start - 1:start - 1 + n], dim=-1)  # [n, V]
        ids_k, logp_k = ids_k.to(device), logp_k.to(device)
        target_p = torch.softmax(logp_k, dim=-1)  # [n, k] renormalised over the top-k
        draft_at = draft_logp.gather(-1, ids_k)  # [n, k]
        kls.append((target_p * (torch.log(target_p.clamp_min(1e-12)) - draft_at)).sum(-1))
        with torch.no_grad():
            agree += float((draft_logp.argmax(-1) == ids_k[:, 0]).sum())
            accept += float(torch.minimum(logp_k.exp(), draft_at.exp()).sum())
            positions += n
    return torch.cat(kls).mean(), agree, accept, positions


@torch.no_grad()
def evaluate(model, data: DistillSet, sequences: list[int], batch_size: int = 8) -> EvalResult:
    model.eval()
    device = next(model.parameters()).device
    agree = accept = loss = 0.0
    positions = 0
    for first in range(0, len(sequences), batch_size):
        kl, a, c, n = _loss_terms(model, data, sequences[first:first + batch_size], device)
        agree, accept, loss, positions = agree + a, accept + c, loss + float(kl) * n, positions + n
    return EvalResult(agree / max(positions, 1), accept / max(positions, 1), loss / max(positions, 1))


def train_draft(draft, data: DistillSet, options: TrainOptions, state_dir: Path | None = None,
                resume: bool = False, stop_after: int | None = None) -> dict:
    """Train ``draft`` in place; returns the history (evaluations, tokens/s). ``state_dir`` keeps checkpoints for
    ``resume``; ``stop_after`` ends the run after that many steps of this call (as a kill would, for tests)."""
    device = next(draft.parameters()).device
    train_set, held_set = split(data, options.held_out, options.seed)
    if not train_set:
        raise ValueError("train-draft: the dataset has no training sequences; give more prompts or tokens")
    tokens_per_seq = sum(data.sequence(s)[2].shape[0] for s in train_set) / len(train_set)
    total_steps = max(1, math.ceil(options.tokens / (tokens_per_seq * options.batch_size)))
    optimiser = torch.optim.AdamW(draft.parameters(), lr=options.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda step: min(1.0, (step + 1) / options.warmup_steps)
                                                 * 0.5 * (1 + math.cos(math.pi * min(step / total_steps, 1.0))))
    generator = torch.Generator().manual_seed(options.seed)
    history = {"options": asdict(options), "total_steps": total_steps, "evals": []}
    step = 0
    state_file = state_dir / STATE_FILE if state_dir is not None else None
    if resume and state_file is not None and state_file.is_file():
        state = torch.load(state_file, weights_only=False)
        if state["options"] != asdict(options):
            raise ValueError(f"--resume: {state_file} was written with other training options; rerun without "
                             f"--resume to start over")
        draft.load_state_dict(state["model"])
        optimiser.load_state_dict(state["optimiser"])
        schedule.load_state_dict(state["schedule"])
        generator.set_state(state["generator"])
        step, history = state["step"], state["history"]
    else:
        history["evals"].append({"step": 0, **asdict(evaluate(draft, data, held_set))})
    eval_every = max(1, total_steps // max(options.evals, 1))
    start, trained_tokens, ran = time.perf_counter(), 0, 0
    bar = tqdm(total=total_steps, initial=step, desc="train draft", unit="step")
    while step < total_steps and (stop_after is None or ran < stop_after):
        draft.train()
        picks = torch.randint(0, len(train_set), (options.batch_size,), generator=generator).tolist()
        loss, _, _, positions = _loss_terms(draft, data, [train_set[i] for i in picks], device)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimiser.step()
        schedule.step()
        step, ran, trained_tokens = step + 1, ran + 1, trained_tokens + positions
        postfix = {"loss": f"{loss.item():.3f}", "tok/s": f"{trained_tokens / (time.perf_counter() - start):.0f}"}
        if step % eval_every == 0 or step == total_steps:
            result = evaluate(draft, data, held_set)
            history["evals"].append({"step": step, **asdict(result)})
            postfix["acceptance"] = f"{result.acceptance:.3f}"
        bar.set_postfix(postfix)
        bar.update(1)
        if state_file is not None and (step % options.checkpoint_every == 0 or step == total_steps):
            state_dir.mkdir(parents=True, exist_ok=True)
            tmp = state_file.with_suffix(".tmp")
            torch.save({"options": asdict(options), "model": draft.state_dict(), "optimiser": optimiser.state_dict(),
                        "schedule": schedule.state_dict(), "generator": generator.get_state(), "step": step,
                        "history": history}, tmp)
            tmp.replace(state_file)  # a kill mid-write leaves the previous checkpoint whole
    bar.close()
    draft.eval()
    history["finished"] = step >= total_steps
    history["tokens_per_s"] = round(trained_tokens / max(time.perf_counter() - start, 1e-9), 1)
    return history
