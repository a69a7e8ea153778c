"""pipeline/executor/serving_loop.py: the engine driven from a background thread for concurrent clients, with
cancellation."""

from __future__ import annotations

import threading

import pytest

from pipeline.executor import SpeculativeExecutor
from pipeline.executor.results import RequestFailed
from pipeline.executor.serving_loop import ServingLoop
from tests.conftest import load_tiny_models
from tests.executor.test_batching_engine_failures import fail_verify_of


PROMPTS = ["def main(", "import os\nimport sys\n", "class Parser:\n    def __init__(self", "x = [1, 2",
           "for i in range(10):\n    ", "return", "if __name__ == '__main__':\n    main()\n"]


@pytest.fixture(scope="module")
def pair(tiny_pair):
    return load_tiny_models(tiny_pair)


def test_engine_loop_serves_concurrent_clients_and_cancels(pair):
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=4, max_batch_size=4, adaptive_draft_len=True)
    expected = {p: r.token_ids for p, r in zip(PROMPTS, ex.generate(PROMPTS, 24))}
    loop = ServingLoop(ex.engine)
    got: dict[int, list[int]] = {}
    done = threading.Event()
    lock = threading.Lock()
    gone = threading.Event()

    def client(i: int):
        prompt = PROMPTS[i % len(PROMPTS)]
        finished = threading.Event()
        tokens: list[int] = []

        def on_event(event):
            tokens.extend(event.token_ids)
            if event.finished:
                finished.set()

        cancelled = (lambda: gone.is_set()) if i == 0 else None
        loop.submit(ex.new_request(prompt, 200 if i == 0 else 24), on_event, is_cancelled=cancelled)
        finished.wait(120)
        with lock:
            got[i] = tokens
            if len(got) == 12:
                done.set()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    gone.set()  # client 0 disconnects; its long request must stop early
    assert done.wait(180)
    loop.stop()
    for i in range(1, 12):
        assert got[i] == expected[PROMPTS[i % len(PROMPTS)]], i
    assert len(got[0]) < 200


def test_a_request_the_engine_fails_alone_is_the_only_one_to_see_an_exception(pair):
    """The target forward raises whenever the victim is in it (after its first tokens): the victim's callback gets
    the error, the other clients get exactly their fault-free tokens and never an exception, and the loop keeps
    serving requests submitted afterwards."""
    target, draft, tok = pair
    ex = SpeculativeExecutor(target, draft, tok, max_draft_len=3, max_batch_size=4)
    kinds = [dict(), dict(temperature=0.9, seed=4), dict(temperature=0.8, seed=9), dict(max_draft_len=0)]
    expected = [r.token_ids for r in ex.run([ex.new_request(PROMPTS[i], 20, **kinds[i]) for i in range(4)])]
    requests = [ex.new_request(PROMPTS[i], 20, **kinds[i]) for i in range(4)]
    victim = requests[2]
    fail_verify_of(ex.engine, victim, after=3)
    loop = ServingLoop(ex.engine)
    seen: dict[int, list] = {request.id: [] for request in requests}
    done = threading.Semaphore(0)

    def on_event_of(request):
        def on_event(event):
            seen[request.id].append(event)
            if isinstance(event, BaseException) or event.finished:
                done.release()
        return on_event

    for request in requests:
        loop.submit(request, on_event_of(request))
    for _ in requests:
        assert done.acquire(timeout=120)
    later = ex.new_request(PROMPTS[0], 20)
    seen[later.id] = []
    loop.submit(later, on_event_of(later))
    assert done.acquire(timeout=120)
    loop.stop()
    assert isinstance(seen[victim.id][-1], RequestFailed)
    assert "injected" in str(seen[victim.id][-1].cause)
    for i, request in enumerate(requests + [later]):
        if request is not victim:
            assert not any(isinstance(event, BaseException) for event in seen[request.id]), i
            assert [t for event in seen[request.id] for t in event.token_ids] == expected[i % 4], i
