"""Which requests run this step: a FIFO queue in front of at most ``max_batch`` running slots.

Pure bookkeeping, no tensors: running requests occupy slots ``0..n-1`` (the KV cache rows of the same index), so
when one finishes the last running request moves into its slot and the rows stay contiguous for every forward.
"""

from __future__ import annotations

from collections import deque

from .request import SpecRequest


class Scheduler:
    def __init__(self, max_batch: int):
        if max_batch < 1:
            raise ValueError(f"max_batch: {max_batch} must be >= 1")
        self.max_batch = max_batch
        self.waiting: deque[SpecRequest] = deque()
        self.running: list[SpecRequest] = []  # index = KV cache slot

    def add(self, request: SpecRequest) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[tuple[int, SpecRequest]]:
        """Move waiting requests into free slots (first come, first served); returns (slot, request) joined."""
        joined = []
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting.popleft()
            if request.finished:  # cancelled while waiting, or nothing to generate
                continue
            self.running.append(request)
            joined.append((len(self.running) - 1, request))
        return joined

    def drop_waiting(self, request: SpecRequest) -> bool:
        """Remove a request that has not started; False if it is not waiting."""
        try:
            self.waiting.remove(request)
        except ValueError:
            return False
        return True

    def retire(self) -> tuple[list[tuple[int, int]], list[int]]:
        """Remove finished requests from the running slots.

        Returns (moves, freed): ``moves`` are (from slot, to slot) copies that keep the running slots contiguous,
        to apply in order; ``freed`` are the slots that end up empty.
        """
        moves: list[tuple[int, int]] = []
        run = self.running
        before = len(run)
        slot = 0
        while slot < len(run):
            if not run[slot].finished:
                slot += 1
                continue
            while len(run) - 1 > slot and run[-1].finished:
                run.pop()
            last = len(run) - 1
            if last == slot:
                run.pop()
                break
            moves.append((last, slot))
            run[slot] = run.pop()
            slot += 1
        return moves, list(range(len(run), before))
