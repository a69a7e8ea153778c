"""pipeline/executor/serving_loop.py: the engine driven from a background thread for concurrent clients, with
cancellation."""

from __future__ import annotations

import threading

import pytest

from pipeline.executor import SpeculativeExecutor
from pipeline.executor.serving_loop import ServingLoop
from tests.conftest import load_tiny_models


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
