"""Run the OpenAI-compatible app beside tritonserver: the app behind its guard, served by an HTTP front.

The listening socket is bound by :func:`reserve_port` before tritonserver starts, so a port in use fails at once
with a one-line error, and nothing else can take the port while the models load; the front starts listening on it
once Triton is ready (pipeline/front/http_server.py: read deadline, connection limit, drain). The app talks to
Triton over gRPC, like any other client.
"""

from __future__ import annotations

import socket

from ..errors import PipelineError
from ..front import http_server
from ..front.guard import GuardSettings, allowed_hosts_for
from ..front.http_server import DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT_S, HttpFront, HttpFrontError
from .app import DEFAULT_REQUEST_TIMEOUT_S, create_app
from .errors import error_body
from .protocol import ServedModel


class OpenAIServerError(PipelineError):
    """The OpenAI-compatible endpoint could not start."""


def reserve_port(host: str, port: int, setting: str = "serve.openai_port") -> socket.socket:
    """A socket bound to (host, port), not yet listening; ``setting`` names where the port came from in errors."""
    fix = ("another server, or a second `serve --openai`? stop it or choose a free port with --openai-port or the "
           "config's serve.openai_port")
    try:
        return http_server.reserve_port(host, port, setting, fix)
    except HttpFrontError as exc:
        raise OpenAIServerError(str(exc)) from None


class OpenAIServer:
    """The endpoint on a reserved socket; start() returns once it accepts connections; drain(), stop() or kill()
    end it.

    ``guard`` defaults to the Host names of the socket's address (allowed_hosts_for), no CORS origin and no API
    key; ``request_timeout_s`` bounds each request (504, or an in-band error in a stream)."""

    def __init__(self, served: ServedModel, triton_grpc: str, sock: socket.socket, *,
                 guard: GuardSettings | None = None, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                 keep_alive_s: float = 5.0):
        host, port = sock.getsockname()[:2]
        guard = guard if guard is not None else GuardSettings(allowed_hosts_for(host, port))
        app = create_app(served, triton_grpc, guard=guard, request_timeout_s=request_timeout_s)
        self._front = HttpFront(app, sock, name="openai-api", max_connections=max_connections,
                                read_timeout_s=read_timeout_s, keep_alive_s=keep_alive_s, error_body=error_body)
        self.sock = sock
        self.url = f"{self._front.url}/v1"  # what a local client uses

    def start(self, timeout_s: float = 30.0) -> OpenAIServer:
        try:
            self._front.start(timeout_s)
        except HttpFrontError as exc:
            raise OpenAIServerError(str(exc)) from None
        return self

    def drain(self, timeout_s: float) -> None:
        """New requests get 503; running ones get ``timeout_s`` to finish, then end with an error (a stream: an
        in-band error event, then ``data: [DONE]``); returns once the port is free."""
        self._front.drain(timeout_s)

    def stop(self) -> None:
        """drain() with a short timeout; the port is free afterwards."""
        self._front.stop()

    def kill(self) -> None:
        """End at once, open streams cut (a second Ctrl-C); a stop() or drain() in progress then returns quickly."""
        self._front.kill()
