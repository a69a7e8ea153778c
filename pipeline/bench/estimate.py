"""How long a bench run will take, said before its timed part starts.

After the warm-up every method generates once from the first prompt (runner.calibrate); a timed generation costs
about that long, so the timed part takes the sum over methods of its seconds x prompts x repeats. A full run
(plan.py) is priced from the same seconds scaled by its token count; a K that was not calibrated costs the median
of its method's calibrated K values (else target-only's). Prompts longer or shorter than the first one, and a
machine whose load changes, move the real figure: it is an estimate, and bench prints the real one at the end.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

Key = tuple[str, int | str]  # (method, K)


@dataclass(frozen=True)
class Estimate:
    generations: int
    seconds: float

    def to_dict(self) -> dict:
        return {"generations": self.generations, "seconds": round(self.seconds, 1)}


def seconds_per_generation(key: Key, calibrated: dict[Key, float]) -> float:
    """One generation of ``key``: its calibrated seconds, else its method's median, else target-only's."""
    if key in calibrated:
        return calibrated[key]
    same = [s for (method, _), s in calibrated.items() if method == key[0]]
    if same:
        return statistics.median(same)
    return calibrated.get(("target", 0), statistics.median(calibrated.values()))


def estimate(keys: list[Key], calibrated: dict[Key, float], prompts: int, repeats: int,
             token_scale: float = 1.0) -> Estimate:
    """The timed part of a run of the methods ``keys`` over ``prompts`` prompts in all, ``repeats`` times, each
    generation ``token_scale`` times as long as the calibrated one."""
    per_round = sum(seconds_per_generation(key, calibrated) for key in keys) * token_scale
    return Estimate(len(keys) * prompts * repeats, per_round * prompts * repeats)


def duration(seconds: float) -> str:
    """"45 s", "3.4 min", "1.6 h"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def announcement(this: Estimate, full: Estimate | None, full_flags: str, shape: str) -> str:
    """What bench prints before its timed part: this run's size and time, and a full run's."""
    text = (f"bench: {this.generations} timed generations ({shape}) will take about {duration(this.seconds)} on "
            f"this machine (each method timed once on the first prompt)")
    if full is None:
        return text + "; this is a full run"
    return text + f"; a full run ({full_flags}) would take about {duration(full.seconds)}"
