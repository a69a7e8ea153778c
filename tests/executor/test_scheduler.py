"""pipeline/executor/scheduler.py: running rows stay contiguous as requests finish and join."""

from __future__ import annotations

from pipeline.executor.scheduler import Scheduler


def test_scheduler_keeps_running_rows_contiguous():
    class Req:
        def __init__(self, name):
            self.name, self.finished = name, False

    scheduler = Scheduler(max_batch=4)
    reqs = [Req(c) for c in "abcdef"]
    for r in reqs:
        scheduler.add(r)
    assert [s for s, _ in scheduler.admit()] == [0, 1, 2, 3]
    reqs[0].finished = reqs[2].finished = reqs[3].finished = True
    moves, freed = scheduler.retire()
    assert moves == [(1, 0)] and freed == [1, 2, 3]
    assert [r.name for r in scheduler.running] == ["b"]
    assert [(s, r.name) for s, r in scheduler.admit()] == [(1, "e"), (2, "f")]
    reqs[1].finished = True
    moves, freed = scheduler.retire()
    assert moves == [(2, 0)] and freed == [2] and [r.name for r in scheduler.running] == ["f", "e"]
