"""The training loop every distilled drafter shares: seeded batches, AdamW with warm-up and cosine decay, held-out
evaluations, resumable checkpoints, a progress bar with ETA.

Deterministic for a seed: batches come from one seeded generator, whose state is checkpointed with the module, the
optimiser and the step, so ``resume`` continues exactly where a killed run stopped.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

STATE_FILE = "train_state.pt"


@dataclass
class _Trainer:
    """What a checkpoint holds besides the step and the history: the module, its optimiser and schedule, and the
    generator the batches come from."""

    module: torch.nn.Module
    options: object
    optimiser: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LambdaLR
    generator: torch.Generator

    @classmethod
    def create(cls, module: torch.nn.Module, options, total_steps: int) -> _Trainer:
        optimiser = torch.optim.AdamW(module.parameters(), lr=options.lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimiser, lambda step: min(1.0, (step + 1) / options.warmup_steps)
            * 0.5 * (1 + math.cos(math.pi * min(step / total_steps, 1.0))))
        return cls(module, options, optimiser, schedule, torch.Generator().manual_seed(options.seed))

    def restore(self, state_file: Path) -> tuple[int, dict]:
        """Load a checkpoint written with the same options; returns its (step, history)."""
        state = torch.load(state_file, weights_only=False)
        if state["options"] != asdict(self.options):
            raise ValueError(f"--resume: {state_file} was written with other training options; rerun without "
                             f"--resume to start over")
        self.module.load_state_dict(state["model"])
        self.optimiser.load_state_dict(state["optimiser"])
        self.schedule.load_state_dict(state["schedule"])
        self.generator.set_state(state["generator"])
        return state["step"], state["history"]

    def save(self, state_file: Path, step: int, history: dict) -> None:
        state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = state_file.with_suffix(".tmp")
        torch.save({"options": asdict(self.options), "model": self.module.state_dict(),
                    "optimiser": self.optimiser.state_dict(), "schedule": self.schedule.state_dict(),
                    "generator": self.generator.get_state(), "step": step, "history": history}, tmp)
        tmp.replace(state_file)  # a kill mid-write leaves the previous checkpoint whole

    def step(self, train_set: list[int], step_loss: Callable[[list[int]], tuple[Tensor, int]]) -> tuple[float, int]:
        """One optimiser step on a seeded batch; returns (loss, positions it covered)."""
        self.module.train()
        picks = torch.randint(0, len(train_set), (self.options.batch_size,), generator=self.generator).tolist()
        loss, positions = step_loss([train_set[i] for i in picks])
        self.optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
        self.optimiser.step()
        self.schedule.step()
        return loss.item(), positions


def fit(module: torch.nn.Module, options, train_set: list[int], tokens_per_seq: float,
        step_loss: Callable[[list[int]], tuple[Tensor, int]], evaluate: Callable[[], dict],
        state_dir: Path | None = None, resume: bool = False, stop_after: int | None = None,
        desc: str = "train") -> dict:
    """Train ``module``'s parameters in place on ``options.tokens`` positions; returns the history.

    ``options``: a dataclass with tokens, batch_size, lr, warmup_steps, evals, checkpoint_every and seed (its
    fields are checked on resume); ``step_loss(sequences)``: (the loss to minimise, positions it covered);
    ``evaluate()``: the held-out figures as a dict (its "acceptance" shows on the bar); ``stop_after``: end after
    that many steps of this call, as a kill would (for tests)."""
    total_steps = max(1, math.ceil(options.tokens / (tokens_per_seq * options.batch_size)))
    trainer = _Trainer.create(module, options, total_steps)
    state_file = state_dir / STATE_FILE if state_dir is not None else None
    if resume and state_file is not None and state_file.is_file():
        step, history = trainer.restore(state_file)
    else:
        step, history = 0, {"options": asdict(options), "total_steps": total_steps,
                            "evals": [{"step": 0, **evaluate()}],
                            "tokens_per_step": round(tokens_per_seq * options.batch_size, 1)}
    eval_every = max(1, total_steps // max(options.evals, 1))
    start, trained_tokens, ran = time.perf_counter(), 0, 0
    bar = tqdm(total=total_steps, initial=step, desc=desc, unit="step")
    while step < total_steps and (stop_after is None or ran < stop_after):
        loss, positions = trainer.step(train_set, step_loss)
        step, ran, trained_tokens = step + 1, ran + 1, trained_tokens + positions
        postfix = {"loss": f"{loss:.3f}", "tok/s": f"{trained_tokens / (time.perf_counter() - start):.0f}"}
        if step % eval_every == 0 or step == total_steps:
            result = evaluate()
            history["evals"].append({"step": step, **result})
            postfix["acceptance"] = f"{result.get('acceptance', 0.0):.3f}"
        bar.set_postfix(postfix)
        bar.update(1)
        if state_file is not None and (step % options.checkpoint_every == 0 or step == total_steps):
            trainer.save(state_file, step, history)
    bar.close()
    module.eval()
    history["finished"] = step >= total_steps
    history["tokens_per_s"] = round(trained_tokens / max(time.perf_counter() - start, 1e-9), 1)
    return history
