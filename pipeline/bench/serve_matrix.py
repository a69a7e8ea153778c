"""The bench-serve matrix: every (path, mode, concurrency) cell, rounds interleaved, each cell's best round.

Modes, for every path (see serve_clients) and concurrency C:

  one_at_a_time      one request in flight at a time (a lock shared by all clients, held from send to last
                     token): serving without in-flight batching; K as a plain request gets it
  target_only        batched, every request max_draft_len = 0
  speculative        batched, K as a plain request gets it (the engine caps K per step from measured costs)
  speculative_fixed  batched, every request names K = the config's K (the engine never caps a named K)

Cells are interleaved over rounds (round 1 of every cell, then round 2, ...) and each cell keeps its best round by
tokens/s: the machine is shared and load from elsewhere only ever makes a round slower. A path's totals reader, read
before and after each cell, gives the cell's prefix cache hit rate and mean batch occupancy (cell_usage).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .load_generator import run_load
from .request_timing import summarize

MODES = ("one_at_a_time", "target_only", "speculative", "speculative_fixed")
PATHS = ("engine", "triton", "triton_stream")
ADAPTIVE = "adaptive"  # a mode's K when the request names none (the engine's K, capped per step)


def mode_draft_len(mode: str, k: int) -> int | None:
    """The K a mode's requests name: None = not named (the engine's K under its adaptive cap)."""
    return {"target_only": 0, "speculative_fixed": k}.get(mode)


@dataclass
class ServeOptions:
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16, 32])
    requests: int = 64  # N per cell, shared among the C clients
    max_tokens: int = 32
    rounds: int = 2
    modes: list[str] = field(default_factory=lambda: list(MODES))
    paths: list[str] = field(default_factory=lambda: list(PATHS))
    hf_rounds: int = 3  # batch-1 target-only vs HF generate (hf_baseline); 0 skips it

    def to_dict(self) -> dict:
        return asdict(self)


def cell_usage(before: dict | None, after: dict | None, max_batch: int) -> dict:
    """A cell's prefix_hit_rate (prompt tokens reused / looked up) and occupancy (mean running requests per engine
    step / max_batch) from the engine totals (serve_clients.engine_totals) read before and after it; None where a
    total is unknown or did not move."""

    def delta(key: str) -> float | None:
        if before is None or after is None or before.get(key) is None or after.get(key) is None:
            return None
        return after[key] - before[key]

    queried, hit, steps, rows = (delta(key) for key in ("queried_tokens", "hit_tokens", "steps", "rows"))
    return {"prefix_hit_rate": round(hit / queried, 3) if queried and hit is not None else None,
            "occupancy": round(rows / steps / max_batch, 3) if steps and rows is not None else None}


def run_matrix(clients: dict[str, Callable[[], object]], prompts: list[list[int]], options: ServeOptions, k: int,
               note: Callable[[str], None] = print, totals: dict[str, Callable[[], dict]] | None = None,
               max_batch: int = 1) -> list[dict]:
    """Every (path, mode, concurrency) cell, rounds interleaved; one record per cell, its best round. ``totals``:
    per path, a reader of the serving engine's running totals (none: the cell's usage fields are None)."""
    totals = totals or {}
    cells = [(path, mode, c) for c in options.concurrency for path in options.paths if path in clients
             for mode in options.modes]
    best: dict[tuple[str, str, int], dict] = {}
    for make in clients.values():  # warm-up: first requests pay connection and allocator costs
        run_load(make, prompts, min(4, options.requests), 2, options.max_tokens, None, False)
    for round_index in range(options.rounds):
        for path, mode, c in cells:
            draft_len = mode_draft_len(mode, k)
            read = totals.get(path)
            before = read() if read else None
            timings, wall = run_load(clients[path], prompts, options.requests, c, options.max_tokens, draft_len,
                                     mode == "one_at_a_time")
            usage = cell_usage(before, read() if read else None, max_batch)
            record = {"path": path, "mode": mode, "concurrency": c,
                      "k": ADAPTIVE if draft_len is None else draft_len, **summarize(timings, wall), **usage}
            key = (path, mode, c)
            if key not in best or record["tokens_per_s"] > best[key]["tokens_per_s"]:
                best[key] = record
            note(f"round {round_index + 1}/{options.rounds} {path:13s} {mode:17s} C={c:<3d} "
                 f"{record['tokens_per_s']:8.1f} tok/s")
    for record in best.values():
        record["best_of_rounds"] = options.rounds  # how many rounds it was the best of
    return [best[key] for key in cells]


def add_ratios(records: list[dict]) -> None:
    """Each record's throughput against one_at_a_time and target_only of the same path and concurrency."""
    index = {(r["path"], r["mode"], r["concurrency"]): r for r in records}
    for r in records:
        for base in ("one_at_a_time", "target_only"):
            other = index.get((r["path"], base, r["concurrency"]))
            r[f"speedup_vs_{base}"] = round(r["tokens_per_s"] / other["tokens_per_s"], 3) if other else None
