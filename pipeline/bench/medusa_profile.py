"""Medusa in `profile`: a tree tuned to the heads, prompts and machine (profile.py then times it).

The tuned tree (pipeline/speculative/tree_search.py) comes from two measurements: the rank each head gives the
target's true token along the target's own greedy text, and the cost of a verify of n tokens and of the heads
relative to a plain step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..methods import Method
from ..speculative.tree_search import best_tree, rank_hits

MAX_RANK = 10  # candidates per depth considered (mc_sim_7b_63 uses at most 10)
MAX_NODES = 63  # TensorRT-LLM's --max_medusa_token_len default
# Verify widths timed; the others are interpolated (every width up to 64 would take minutes on a CPU).
TIMED_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
COST_REPEATS = 5


@dataclass
class TunedTree:
    paths: list[list[int]]  # empty: no tree beats plain decoding on these measurements
    expected_tokens: float  # per step, under the independence assumption
    expected_speedup: float
    hits: list[list[float]]  # [heads, MAX_RANK] share of positions where head h ranked the true token r
    step_cost: list[float]  # [nodes + 1] a step verifying n candidates, heads included, over a plain step
    free_verify: tuple[int, float]  # (nodes, expected tokens per step) of the best tree were a verify free

    def describe(self) -> str:
        top = " ".join(f"{sum(row[:1]):.2f}/{sum(row[:3]):.2f}/{sum(row):.2f}" for row in self.hits)
        nodes, tokens = self.free_verify
        # Where verifying 64 tokens costs about one step (a GPU at small batch), the tree can be wide.
        free = f"; were a {nodes + 1}-token verify as cheap as a plain step, {tokens:.2f} tokens per step"
        if not self.paths:
            return (f"medusa tree: none pays on this machine (true token in each head's top 1/3/{MAX_RANK}: {top}; "
                    f"a step verifying 1/3/15 candidates costs {self.step_cost[1]:.2f}/{self.step_cost[3]:.2f}/"
                    f"{self.step_cost[15]:.2f}x a plain one{free})")
        return (f"medusa tree tuned to these prompts: {len(self.paths)} nodes, depth "
                f"{max(len(p) for p in self.paths)}, expected {self.expected_tokens:.2f} tokens per step at "
                f"{self.step_cost[len(self.paths)]:.2f}x a plain step's cost = {self.expected_speedup:.2f}x (true "
                f"token in each head's top 1/3/{MAX_RANK}: {top}{free}); measured below. choices: {self.paths}")


@torch.inference_mode()
def tune_tree(target_path: Path, heads_dir: Path, prompts: list, max_new_tokens: int, device: str,
              dtype: str) -> TunedTree:
    from ..executor import SpeculativeExecutor
    from ..medusa_heads import MedusaHeads
    from .runner import fit_prompt

    depth = MedusaHeads.load(heads_dir).num_heads
    executor = SpeculativeExecutor.from_pretrained(target_path, None, device=device, dtype=dtype,
                                                   method=Method.MEDUSA, medusa=heads_dir,
                                                   medusa_choices=[[0] * d for d in range(1, depth + 1)])
    heads = executor.engine.proposers[Method.MEDUSA].heads
    model = executor.target.model
    ids = [fit_prompt(executor, p, max_new_tokens) for p in prompts]
    ranks = []
    for prompt, result in zip(ids, executor.generate(ids, max_new_tokens, max_draft_len=0)):
        sequence = prompt + result.token_ids
        hidden = model(torch.tensor([sequence], device=executor.device),
                       output_hidden_states=True).hidden_states[-1][0]  # [L, d]
        # Hidden state at p: head h ranks token p + h + 2 (the verify already gave token p + 1).
        positions = list(range(len(prompt) - 1, len(sequence) - 2))
        ranked = heads.top_tokens(hidden[positions], [MAX_RANK] * depth)  # [heads][P, R]
        for i, p in enumerate(positions):
            row = []
            for h in range(depth):
                truth = sequence[p + h + 2] if p + h + 2 < len(sequence) else None
                found = (ranked[h][i] == truth).nonzero() if truth is not None else []
                row.append(int(found[0]) if len(found) else -1)
            ranks.append(row)
    hits = rank_hits(torch.tensor(ranks), MAX_RANK)
    cost, heads_cost = _step_costs(executor, heads, max(ids, key=len), depth)
    paths, tokens, speedup = best_tree(hits, lambda n: cost[n], MAX_NODES)
    free, free_tokens, _ = best_tree(hits, lambda n: 1.0 + (heads_cost if n else 0.0), MAX_NODES)
    return TunedTree(paths, tokens, speedup, hits.tolist(), cost, (len(free), free_tokens))


def _step_costs(executor, heads, context: list[int], depth: int) -> tuple[list[float], float]:
    """([n] for n = 0..MAX_NODES: a step verifying n candidates (n + 1 tokens) plus the heads, over a plain step;
    the heads alone, over a plain step)."""
    from .timing import _time_forward, timing_sequence

    runner = executor.target
    times = {w: [] for w in TIMED_WIDTHS}
    hidden = torch.zeros(1, heads.hidden_size, device=executor.device)
    head_times = []
    with timing_sequence([runner], context):
        for rep in range(COST_REPEATS + 1):
            for width in TIMED_WIDTHS:
                times[width].append(_time_forward(runner, len(context), (context * 64)[:width]))
            start = time.perf_counter()
            heads.top_tokens(hidden, [MAX_RANK] * depth)
            head_times.append(time.perf_counter() - start)
    best = {w: min(t[1:]) for w, t in times.items()}  # the first round warms up
    plain = best[1]
    head_cost = min(head_times[1:]) / plain

    def verify(width: int) -> float:
        lower = max(w for w in TIMED_WIDTHS if w <= width)
        upper = min((w for w in TIMED_WIDTHS if w >= width), default=lower)
        share = 0.0 if upper == lower else (width - lower) / (upper - lower)
        return (best[lower] * (1 - share) + best[upper] * share) / plain

    return [1.0] + [verify(n + 1) + head_cost for n in range(1, MAX_NODES + 1)], head_cost
