"""Which requests run this step: a FIFO queue in front of at most ``max_batch`` running requests.

Pure bookkeeping, no tensors: the running requests are a list in arrival order (their KV lives in per-request
block tables, so one leaving moves nobody); a request joins when the batch has room and the caller's ``fits`` says
its memory does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from .request import SpecRequest


class Scheduler:
    def __init__(self, max_batch: int):
        if max_batch < 1:
            raise ValueError(f"max_batch: {max_batch} must be >= 1")
        self.max_batch = max_batch
        self.waiting: deque[SpecRequest] = deque()
        self.running: list[SpecRequest] = []

    def add(self, request: SpecRequest) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self, fits: Callable[[SpecRequest, list[SpecRequest]], bool] | None = None) -> list[SpecRequest]:
        """Move waiting requests into the batch, first come first served, while ``fits(request, running)`` (the
        head waits, never overtaken, until it fits); returns the requests that joined."""
        joined = []
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting[0]
            if request.finished:  # cancelled while waiting, or nothing to generate
                self.waiting.popleft()
                continue
            if fits is not None and self.running and not fits(request, self.running):
                break
            self.running.append(self.waiting.popleft())
            joined.append(request)
        return joined

    def drop_waiting(self, request: SpecRequest) -> bool:
        """Remove a request that has not started; False if it is not waiting."""
        try:
            self.waiting.remove(request)
        except ValueError:
            return False
        return True

    def retire(self) -> list[SpecRequest]:
        """Remove finished requests from the batch; returns them."""
        done = [request for request in self.running if request.finished]
        self.running = [request for request in self.running if not request.finished]
        return done
