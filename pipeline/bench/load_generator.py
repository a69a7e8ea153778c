"""One load: C client threads send their share of N requests, each after the previous one completed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .request_timing import RequestTiming


def run_load(make_client: Callable[[], object], prompts: list[list[int]], requests: int, concurrency: int,
             max_tokens: int, k: int | None, one_at_a_time: bool, method: str | None = None
             ) -> tuple[list[RequestTiming], float]:
    """Client c sends requests c, c + C, c + 2C, ... (prompts in turn), each after the previous completed, naming
    K ``k`` and drafting method ``method`` where not None; with ``one_at_a_time`` a lock shared by all clients, held
    from send to last token, keeps one request in flight. Returns every request's timing and the wall time from the
    first send to the last completion."""
    clients = [make_client() for _ in range(concurrency)]  # connected before the clock starts
    lock = threading.Lock() if one_at_a_time else None
    timings: list[RequestTiming | None] = [None] * requests
    errors: list[BaseException] = []
    barrier = threading.Barrier(concurrency + 1)

    def work(slot: int) -> None:
        barrier.wait()
        try:
            for i in range(slot, requests, concurrency):
                prompt = prompts[i % len(prompts)]
                if lock is None:
                    timings[i] = clients[slot].send(prompt, max_tokens, k, method)
                else:
                    queued = time.perf_counter()
                    with lock:
                        timings[i] = clients[slot].send(prompt, max_tokens, k, method)
                    timings[i].queued_since(queued)  # the lock's wait is queueing, as in the batched modes
        except BaseException as exc:  # noqa: BLE001 - reported once every thread has stopped
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(slot,), daemon=True) for slot in range(concurrency)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    for client in clients:
        client.close()
    failed = [t.error for t in timings if t is not None and t.error]
    if errors or failed or any(t is None for t in timings):
        raise RuntimeError(f"serving load failed: {errors[:1] or failed[:1] or 'a request got no answer'}")
    return timings, wall  # type: ignore[return-value]
