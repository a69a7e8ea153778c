"""Drive the batching engine from a background thread for a server: submit, cancel, per-request events.

Other threads (the Triton model's execute, bench-serve's clients, tests) call :meth:`ServingLoop.submit` (with an
optional key), :meth:`ServingLoop.cancel` or :meth:`ServingLoop.cancel_key` (by that key, for a proxy that never
holds the request object); the loop thread alone touches the engine. Between steps it takes in new requests and
cancellations and asks each submitted request's ``is_cancelled`` (e.g. Triton's ``response_sender.is_cancelled``),
so a client that went away frees its slot within one step. A request with nothing to generate (max_new_tokens 0)
gets its final event at once, without the engine. Each request's events reach its ``on_event(event)`` callback, on
the loop thread. A request the engine failed alone (its own proposal, verify or sampling raised) gets that exception
as its last event and the others never notice; only a step that fails outside every row delivers its exception to
every request it holds. Either way the loop keeps serving.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .request import SpecRequest
from .results import StreamEvent

EventCallback = Callable[[StreamEvent | BaseException], None]


@dataclass
class _Entry:
    request: SpecRequest
    on_event: EventCallback
    is_cancelled: Callable[[], bool] | None
    key: str | None


class ServingLoop:
    def __init__(self, engine, on_step: Callable[[int, int], None] | None = None):
        """``on_step(running, waiting)`` is called after every step (metrics)."""
        self.engine = engine
        self.on_step = on_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._entries: dict[int, _Entry] = {}  # request id -> entry (loop thread only)
        self._keys: dict[str, int] = {}  # client key -> request id (loop thread only)
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="speculative-engine", daemon=True)
        self._thread.start()

    # ---- any thread ----------------------------------------------------------------------------------------------

    def submit(self, request: SpecRequest, on_event: EventCallback,
               is_cancelled: Callable[[], bool] | None = None, key: str | None = None) -> None:
        self._inbox.put(("submit", _Entry(request, on_event, is_cancelled, key)))

    def cancel(self, request: SpecRequest) -> None:
        self._inbox.put(("cancel", request.id))

    def cancel_key(self, key: str) -> None:
        """Cancel the request submitted with ``key`` (a proxy that cannot reach the request object)."""
        self._inbox.put(("cancel_key", key))

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped = True
        self._inbox.put(("wake", None))
        self._thread.join(timeout)

    # ---- the loop thread -------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            self._take_inbox(block=not self.engine.has_work())
            self._poll_cancelled()
            if not self.engine.has_work():
                continue
            try:
                events = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - the engine isolates rows' failures; this one was no row's
                self._fail_running(exc)
                continue
            for request, event in events:
                self._deliver(request.id, event)
            if self.on_step is not None:
                self.on_step(self.engine.running, self.engine.waiting)

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, op: str, payload) -> None:
        if op == "submit":
            entry: _Entry = payload
            self._entries[entry.request.id] = entry
            if entry.key is not None:
                self._keys[entry.key] = entry.request.id
            if entry.request.finished:  # nothing to generate (max_new_tokens 0)
                self._deliver(entry.request.id, StreamEvent([], "", True, entry.request.finish_reason,
                                                            entry.request.stats))
            else:
                self.engine.add(entry.request)
        elif op == "cancel":
            self._cancel(payload)
        elif op == "cancel_key":
            request_id = self._keys.get(payload)
            if request_id is not None:
                self._cancel(request_id)

    def _cancel(self, request_id: int) -> None:
        entry = self._entries.get(request_id)
        if entry is not None:
            event = self.engine.cancel(entry.request)
            if event is not None:
                self._deliver(request_id, event)

    def _poll_cancelled(self) -> None:
        for request_id, entry in list(self._entries.items()):
            if entry.is_cancelled is None:
                continue
            try:
                gone = entry.is_cancelled()
            except Exception:  # noqa: BLE001 - a sender that cannot answer has lost its client
                gone = True
            if gone:
                self._cancel(request_id)

    def _fail_running(self, exc: Exception) -> None:
        """The last resort for a step that failed outside every row: each request it holds gets the exception."""
        for request_id, entry in list(self._entries.items()):
            self.engine.cancel(entry.request)
            self._deliver(request_id, exc)

    def _deliver(self, request_id: int, event: StreamEvent | BaseException) -> None:
        """``event`` to the request's callback; a failed request's last event is delivered as its exception."""
        entry = self._entries.get(request_id)
        if entry is None:
            return
        if isinstance(event, StreamEvent) and event.error is not None:
            event = event.error
        final = isinstance(event, BaseException) or event.finished
        if final:
            del self._entries[request_id]
            if entry.key is not None:
                self._keys.pop(entry.key, None)
        try:
            entry.on_event(event)
        except Exception:  # noqa: BLE001 - a callback that fails (client gone) must not stop the loop
            if not final:
                self._cancel(request_id)
