"""Run an ASGI app with uvicorn on a thread, on a socket bound before anything else starts, against hostile clients.

The socket is bound by :func:`reserve_port` first, so a port in use fails at once with a one-line error and nothing
else can take it while Triton loads; :class:`HttpFront` starts listening on it later. uvicorn runs on its own
thread, where it installs no signal handlers: the caller's handlers stay in charge and call drain(), stop() or kill().

What the front adds to uvicorn's HTTP/1.1 server:

- a read deadline: a connection that has not delivered a whole request (headers and body) within ``read_timeout_s``
  is closed (408 when part of one came), so half-open connections cannot pile up;
- a connection limit: past ``max_connections`` open connections a new request gets a 503 at once, and past twice
  the limit a new connection is closed unanswered, so a flood cannot exhaust file descriptors;
- quiet disconnects: a client that goes away mid-request is not an error, and prints no traceback;
- drain(timeout_s): new requests get 503, running ones get ``timeout_s`` to finish; then the app is told through
  :func:`drain_deadline` and gets ``end_grace_s`` to end what still runs the way its protocol allows (an error event
  and the stream's end marker), and whatever runs after that is cut.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import socket
import threading
import time
from collections.abc import Callable

import h11
import uvicorn
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import PipelineError
from .guard import ErrorBody, respond

DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_READ_TIMEOUT_S = 30.0
END_GRACE_S = 5.0  # after the drain deadline: time for the app to send its in-band errors before requests are cut
STOP_DRAIN_S = 5.0  # stop() is a drain this long
CUT_GRACE_S = 1.0  # cancelled requests get this long to run their clean-up (cancel their Triton requests)
JOIN_S = 10.0
DRAIN_KEY = "pipeline.front.drain_deadline"  # the ASGI scope key of the drain deadline's event

log = logging.getLogger(__name__)


class HttpFrontError(PipelineError):
    """An HTTP front could not bind or start."""


def reserve_port(host: str, port: int, setting: str, fix: str) -> socket.socket:
    """A socket bound to (host, port), not yet listening; errors name ``setting`` and say ``fix``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers do not count
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise HttpFrontError(f"{setting}: {port} on {host} is in use ({exc.strerror}); {fix}") from None
    return sock


def plain_error_body(status: int, message: str) -> dict:
    """Triton's error body, ``{"error": message}``: the default for a front's own answers."""
    return {"error": message}


def drain_deadline(scope) -> asyncio.Event:
    """The event a front sets when its drain deadline passes: a request still running then ends the way its
    protocol allows, within the front's end_grace_s (a stream sends an error event and its end marker). Outside a
    front, an event that is never set."""
    event = scope.get(DRAIN_KEY)
    return event if event is not None else asyncio.Event()


class HttpFront:
    """``app`` served on ``sock`` (from reserve_port); start() returns once it accepts connections.

    ``name`` names the server in messages and its thread; ``error_body(status, message)`` makes the body of the
    front's own answers (503, 408) in the app's error format."""

    def __init__(self, app, sock: socket.socket, *, name: str, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, keep_alive_s: float = 5.0,
                 error_body: ErrorBody = plain_error_body, end_grace_s: float = END_GRACE_S):
        for setting, value in (("max_connections", max_connections), ("read_timeout_s", read_timeout_s),
                               ("keep_alive_s", keep_alive_s), ("end_grace_s", end_grace_s)):
            if not value > 0:
                raise ValueError(f"{setting}: {value!r} must be > 0")
        self.sock = sock
        self.name = name
        self.max_connections = max_connections
        self.read_timeout_s = read_timeout_s
        self.end_grace_s = end_grace_s
        self.error_body = error_body
        host, port = sock.getsockname()[:2]
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # a wildcard address is reached via loopback
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"  # what a local client uses
        self.draining = False  # read and written on the server's thread only
        self.cutting = False  # the same: set once requests still running are being cancelled
        self.deadline = asyncio.Event()  # set on the server's thread, once the drain deadline passes
        config = uvicorn.Config(_Front(app, self), http=functools.partial(_Connection, front=self), ws="none",
                                loop="asyncio", lifespan="on", log_level="warning", access_log=False,
                                proxy_headers=False, server_header=False, timeout_keep_alive=keep_alive_s)
        self._server = _Server(config, self)
        self._thread: threading.Thread | None = None
        self._draining: concurrent.futures.Future | None = None

    def start(self, timeout_s: float = 30.0) -> HttpFront:
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.sock]}, name=self.name,
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.kill()
                self._finish()
                raise HttpFrontError(f"the {self.name} on {self.url} did not start within {timeout_s:g} s (see the "
                                     f"uvicorn messages above)")
            time.sleep(0.02)
        return self

    def drain(self, timeout_s: float) -> None:
        """Refuse new requests (503), give running ones ``timeout_s`` to finish, then end them (see the module
        docstring), then stop; returns once the port is free. Safe to call again, or after stop()/kill()."""
        loop = self._server.loop
        if self._thread is None:
            return
        if self._thread.is_alive() and loop is not None and not self._server.force_exit:
            try:
                self._draining = asyncio.run_coroutine_threadsafe(self._drain(timeout_s), loop)
                self._draining.result(timeout_s + self.end_grace_s + JOIN_S)
            except (RuntimeError, TimeoutError, concurrent.futures.CancelledError):
                pass  # the loop had closed, or kill() cut the drain short: stopping is all that is left
        self._finish()

    def stop(self) -> None:
        """drain() with a short timeout (STOP_DRAIN_S)."""
        self.drain(STOP_DRAIN_S)

    def kill(self) -> None:
        """End at once, running requests cut (within uvicorn's 0.1 s tick); returns without waiting (a signal
        handler may call it), and a drain() or stop() in progress then returns quickly."""
        self._server.force_exit = True
        self._server.should_exit = True
        if self._draining is not None:
            self._draining.cancel()

    async def _drain(self, timeout_s: float) -> None:
        self.draining = True
        tasks = self._server.server_state.tasks
        for connection in list(self._server.server_state.connections):
            _quietly(connection.shutdown)  # idle ones close now, busy ones after their answer
        if not await _settled(tasks, timeout_s):
            self.deadline.set()
            await _settled(tasks, self.end_grace_s)

    def _finish(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(JOIN_S)
            if self._thread.is_alive():
                log.warning("%s: its thread did not end within %g s; leaving it", self.name, JOIN_S)
            self._thread = None
        self.sock.close()

    async def crowded(self, scope, receive, send) -> None:
        """The app of a connection opened past max_connections."""
        message = (f"server: over its limit of {self.max_connections} open connections; retry shortly, or close "
                   f"idle connections")
        await respond(send, 503, self.error_body(503, message), [(b"retry-after", b"1")])


async def _settled(tasks: set, timeout_s: float) -> bool:
    """Whether ``tasks`` (a live set) emptied within timeout_s."""
    end = asyncio.get_running_loop().time() + timeout_s
    while tasks and asyncio.get_running_loop().time() < end:
        await asyncio.sleep(0.02)
    return not tasks


def _quietly(action: Callable[[], None]) -> None:
    try:
        action()
    except h11.LocalProtocolError:  # the connection was in a state that is closing anyway
        pass


class _Front:
    """The outermost ASGI layer: 503 while draining, the drain deadline in every scope, quiet disconnects."""

    def __init__(self, app, front: HttpFront):
        self.app = app
        self.front = front

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.front.draining:
            message = "server: shutting down; retry on another server, or once this one is back"
            await respond(send, 503, self.front.error_body(503, message))
            return
        scope[DRAIN_KEY] = self.front.deadline
        try:
            await self.app(scope, receive, send)
        except ClientDisconnect:  # the client went away mid-request: nobody is left to tell, nothing is wrong
            log.info("%s: client went away during %s %s", self.front.name, scope["method"], scope["path"])
        except asyncio.CancelledError:
            if not self.front.cutting:
                raise
            # Cut by the front itself (its connection is already closed): one line, not uvicorn's traceback.
            log.warning("%s: cut %s %s, still running when the server stopped", self.front.name, scope["method"],
                        scope["path"])


class _Connection(H11Protocol):
    """uvicorn's HTTP/1.1 connection plus the front's read deadline and connection limit.

    The read timer runs while the client owes part of a request: from the connection's start, and from the first
    byte of each next request, until the request's last byte; uvicorn's keep-alive timer covers the idle time
    between requests."""

    def __init__(self, *args, front: HttpFront, **kwargs):
        super().__init__(*args, **kwargs)
        self.front = front
        self.read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        already_open = len(self.connections)
        super().connection_made(transport)
        if already_open >= 2 * self.front.max_connections:
            transport.abort()
            return
        if already_open >= self.front.max_connections:
            self.app = self.front.crowded
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.read_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()  # a pipelined request may have started meanwhile

    def _watch(self) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY or (state is h11.IDLE and self.conn.trailing_data[0]):
            if self.read_timer is None:
                self._arm()
        elif state is not h11.IDLE:  # the request is complete (or the connection is over)
            self._disarm()

    def _arm(self) -> None:
        self.read_timer = self.loop.call_later(self.front.read_timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        if self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None

    def _read_timed_out(self) -> None:
        self.read_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle if self.cycle is not None and not self.cycle.response_complete else None
        if cycle is not None:
            cycle.disconnected = True  # the app sees a disconnect; anything it still sends goes nowhere
            cycle.message_event.set()
        partial = self.conn.their_state is not h11.IDLE or self.conn.trailing_data[0]
        if partial and (cycle is None or not cycle.response_started):
            message = (f"request: headers and body did not arrive within {self.front.read_timeout_s:g} s; send "
                       f"the whole request at once (this server closes slow connections)")
            self._write_408(message)
        self.transport.close()

    def _write_408(self, message: str) -> None:
        body = json.dumps(self.front.error_body(408, message), separators=(",", ":")).encode() + b"\n"
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            data = self.conn.send(h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"))
            data += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:  # h11 cannot answer in this state; closing says enough
            return
        self.transport.write(data)


class _Server(uvicorn.Server):
    """uvicorn's server with its loop at hand (for drain) and a shutdown that ends every connection."""

    def __init__(self, config: uvicorn.Config, front: HttpFront):
        super().__init__(config)
        self.front = front
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:
            server.close()
        state = self.server_state
        for connection in list(state.connections):
            _quietly(connection.shutdown)
        if not self.force_exit:
            await _settled(state.tasks, CUT_GRACE_S)
        self.cut()
        if state.tasks:
            await asyncio.wait(list(state.tasks), timeout=CUT_GRACE_S)
        if not self.force_exit:
            await self.lifespan.shutdown()

    def cut(self) -> None:
        """Close every connection, then cancel every running request (in that order, so each request finds its
        connection gone and ends without an error of its own)."""
        self.front.cutting = True
        for connection in list(self.server_state.connections):
            connection.transport.abort()
        for task in list(self.server_state.tasks):
            task.cancel()
