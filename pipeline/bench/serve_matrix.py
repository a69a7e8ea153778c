"""The bench-serve matrix: every (path, mode, concurrency) cell, rounds interleaved, each cell's median round.

Modes, for every path (see serve_clients) and concurrency C:

  one_at_a_time      one request in flight at a time (a lock shared by all clients, held from send to last
                     token): serving without in-flight batching; K as a plain request gets it
  target_only        batched, every request max_draft_len = 0 (speculation off)
  speculative        batched, K not named: the engine's policy picks each row's K per step from measured costs
  speculative_fixed  batched, every request names K = the config's K (the engine never lowers a named K)
  speculative_kN     batched, every request names K = N (for the best fixed K over several)
  method_NAME        batched, every request names the drafting method NAME (speculative_method), K not named: each
                     method the served engines can run, under the policy, beside the config's default

Cells are interleaved over rounds (round 1 of every cell, then round 2, ...); a cell's record is its median round by
tokens/s, with every round's rate, their min / median / max and whether they lie within +-5% of the median
(serve_metrics). A path's totals reader, read before and after each round, gives the cell's prefix cache hit rate,
mean batch occupancy, engine steps (for the achieved weight bandwidth) and, where the engine exports them,
per-position acceptance (cell_usage). Each request's output is compared with target_only's for the same prompt on
the same path and concurrency (exact match, greedy).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .load_generator import run_load
from .request_timing import summarize
from .serve_metrics import acceptance_summary, exact_match, median_round, position_rates, request_positions, spread

MODES = ("one_at_a_time", "target_only", "speculative", "speculative_fixed")
PATHS = ("engine", "triton", "triton_stream", "openai")
ADAPTIVE = "adaptive"  # a mode's K when the request names none (the engine's K, capped per step)


FIXED_K = re.compile(r"speculative_k(\d+)$")  # a further fixed-K mode: speculative_k2 names K = 2 on every request


METHOD_PREFIX = "method_"  # a method mode: method_suffix sends speculative_method "suffix", K not named


def is_mode(mode: str) -> bool:
    from ..methods import Method

    method = mode.removeprefix(METHOD_PREFIX) if mode.startswith(METHOD_PREFIX) else None
    return mode in MODES or FIXED_K.match(mode) is not None or method in {m.value for m in Method}


def mode_method(mode: str) -> str | None:
    """The drafting method a mode's requests name (None: the served default)."""
    return mode.removeprefix(METHOD_PREFIX) if mode.startswith(METHOD_PREFIX) else None


def mode_draft_len(mode: str, k: int) -> int | None:
    """The K a mode's requests name: None = not named (the engine's policy chooses each row's K per step)."""
    if (fixed := FIXED_K.match(mode)) is not None:
        return int(fixed.group(1))
    return {"target_only": 0, "speculative_fixed": k}.get(mode)


@dataclass
class ServeOptions:
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    requests: int = 64  # N per cell, shared among the C clients
    max_tokens: int = 32
    rounds: int = 3
    modes: list[str] = field(default_factory=lambda: list(MODES))
    paths: list[str] = field(default_factory=lambda: list(PATHS))
    hf_rounds: int = 3  # batch-1 target-only vs HF generate (hf_baseline); 0 skips it

    def to_dict(self) -> dict:
        return asdict(self)


def cell_usage(before: dict | None, after: dict | None, max_batch: int) -> dict:
    """A cell's prefix_hit_rate (prompt tokens reused / looked up), occupancy (mean running requests per engine
    step / max_batch), engine_steps, and per-position acceptance where the totals carry position counts, from the
    engine totals (serve_clients.engine_totals / triton_totals) read before and after it; None where a total is
    unknown or did not move."""

    def delta(key: str) -> float | None:
        if before is None or after is None or before.get(key) is None or after.get(key) is None:
            return None
        return after[key] - before[key]

    queried, hit, steps, rows = (delta(key) for key in ("queried_tokens", "hit_tokens", "steps", "rows"))
    positions = None
    if before is not None and after is not None and after.get("drafted_at") is not None:
        width = len(after["drafted_at"])

        def pad(values):  # a position the counters had not reached before the cell counts from 0
            return list(values or []) + [0] * (width - len(values or []))

        drafted = [a - b for a, b in zip(after["drafted_at"], pad(before.get("drafted_at")))]
        accepted = [a - b for a, b in zip(pad(after.get("accepted_at")), pad(before.get("accepted_at")))]
        positions = position_rates(drafted, accepted)
    return {"prefix_hit_rate": round(hit / queried, 3) if queried and hit is not None else None,
            "occupancy": round(rows / steps / max_batch, 3) if steps and rows is not None else None,
            "engine_steps": int(steps) if steps is not None else None, "total_positions": positions}


def run_matrix(clients: dict[str, Callable[[], object]], prompts: list[list[int]], options: ServeOptions, k: int,
               note: Callable[[str], None] = print, totals: dict[str, Callable[[], dict]] | None = None,
               max_batch: int = 1, weight_bytes: int | None = None, phases: dict | None = None) -> list[dict]:
    """Every (path, mode, concurrency) cell, rounds interleaved; one record per cell: its median round, with the
    spread of all rounds and exact match against target_only on the same path and concurrency. ``totals``: per path,
    a reader of the serving engine's running totals (none: the cell's usage fields are None); ``weight_bytes``: the
    target's, for the achieved weight bandwidth; ``phases`` gets the warm-up's seconds (``warmup_s``)."""
    totals = totals or {}
    cells = [(path, mode, c) for c in options.concurrency for path in options.paths if path in clients
             for mode in options.modes]
    rounds: dict[tuple[str, str, int], list[dict]] = {}
    started = time.perf_counter()
    for make in clients.values():  # warm-up: first requests pay connection and allocator costs
        run_load(make, prompts, min(4, options.requests), 2, options.max_tokens, None, False)
    if phases is not None:
        phases["warmup_s"] = round(time.perf_counter() - started, 2)
    for round_index in range(options.rounds):
        for path, mode, c in cells:
            record = run_cell(clients[path], prompts, options, (path, mode, c), k, totals.get(path), max_batch,
                              weight_bytes)
            rounds.setdefault((path, mode, c), []).append(record)
            note(f"round {round_index + 1}/{options.rounds} {path:13s} {mode:17s} C={c:<3d} "
                 f"{record['tokens_per_s']:8.1f} tok/s")
    records = {key: {**median_round(rounds[key]), **spread([r["tokens_per_s"] for r in rounds[key]])}
               for key in cells}
    for (path, mode, c), record in records.items():
        reference = records.get((path, "target_only", c))
        record["exact_match"] = exact_match(record["outputs"], reference["outputs"]) if reference else None
    for record in records.values():
        del record["outputs"]
    return [records[key] for key in cells]


def run_cell(make_client: Callable[[], object], prompts: list[list[int]], options: ServeOptions,
             cell: tuple[str, str, int], k: int, read: Callable[[], dict] | None, max_batch: int,
             weight_bytes: int | None) -> dict:
    """One round of one cell: its load, summarized, with its engine usage and acceptance figures and every
    request's output (for exact match; removed before the record is written)."""
    path, mode, c = cell
    draft_len = mode_draft_len(mode, k)
    before = read() if read else None
    timings, wall = run_load(make_client, prompts, options.requests, c, options.max_tokens, draft_len,
                             mode == "one_at_a_time", mode_method(mode))
    usage = cell_usage(before, read() if read else None, max_batch)
    totals_positions = usage.pop("total_positions")
    steps = usage["engine_steps"]
    return {"path": path, "mode": mode, "concurrency": c, "k": ADAPTIVE if draft_len is None else draft_len,
            **summarize(timings, wall), **usage, **acceptance_summary(timings),
            "per_position_acceptance": request_positions(timings) or totals_positions,
            "weight_gb_per_s": round(weight_bytes * steps / wall / 1e9, 3) if weight_bytes and steps else None,
            "outputs": [t.output for t in timings]}


def add_ratios(records: list[dict]) -> None:
    """Each record's throughput against one_at_a_time and target_only of the same path and concurrency."""
    index = {(r["path"], r["mode"], r["concurrency"]): r for r in records}
    for r in records:
        for base in ("one_at_a_time", "target_only"):
            other = index.get((r["path"], base, r["concurrency"]))
            r[f"speedup_vs_{base}"] = round(r["tokens_per_s"] / other["tokens_per_s"], 3) if other else None
