"""pipeline/executor/scheduler.py: first come first served within the batch size and the memory the caller allows."""

from __future__ import annotations

from pipeline.executor.scheduler import Scheduler


class Req:
    def __init__(self, name, size=1):
        self.name, self.size, self.finished = name, size, False


def test_scheduler_admits_in_order_and_retires_without_moving_the_others():
    scheduler = Scheduler(max_batch=4)
    reqs = [Req(c) for c in "abcdef"]
    for r in reqs:
        scheduler.add(r)
    assert [r.name for r in scheduler.admit()] == ["a", "b", "c", "d"]
    reqs[0].finished = reqs[2].finished = reqs[3].finished = True
    assert [r.name for r in scheduler.retire()] == ["a", "c", "d"]
    assert [r.name for r in scheduler.running] == ["b"]
    assert [r.name for r in scheduler.admit()] == ["e", "f"]
    reqs[1].finished = True
    assert [r.name for r in scheduler.retire()] == ["b"] and [r.name for r in scheduler.running] == ["e", "f"]


def test_scheduler_head_waits_for_memory_and_is_never_overtaken():
    scheduler = Scheduler(max_batch=8)
    budget = 10

    def fits(request, running):
        return sum(r.size for r in running) + request.size <= budget

    big, small = Req("big", 6), Req("small", 1)
    for r in (Req("a", 6), big, small):
        scheduler.add(r)
    assert [r.name for r in scheduler.admit(fits)] == ["a"]  # big does not fit beside a; small waits behind it
    assert [r.name for r in scheduler.waiting] == ["big", "small"]
    scheduler.running[0].finished = True
    scheduler.retire()
    assert [r.name for r in scheduler.admit(fits)] == ["big", "small"]


def test_scheduler_admits_one_request_even_past_the_memory_check():
    """Alone in the batch a request always runs (the pool is sized to hold one at its longest)."""
    scheduler = Scheduler(max_batch=2)
    scheduler.add(Req("huge", 100))
    assert [r.name for r in scheduler.admit(lambda request, running: False)] == ["huge"]
