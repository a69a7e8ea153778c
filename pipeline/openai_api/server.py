"""Run the OpenAI-compatible app with uvicorn on a thread beside tritonserver.

The listening socket is bound by :func:`reserve_port` before tritonserver starts, so a port in use fails at once
with a one-line error, and nothing else can take the port while the models load; uvicorn starts listening on it
once Triton is ready. The app talks to Triton over gRPC, like any other client.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from ..errors import PipelineError
from .app import create_app
from .protocol import ServedModel

GRACEFUL_STOP_S = 5.0  # open streams get this long to finish on Ctrl-C; then they are cut


class OpenAIServerError(PipelineError):
    """The OpenAI-compatible endpoint could not start."""


def reserve_port(host: str, port: int, setting: str = "serve.openai_port") -> socket.socket:
    """A socket bound to (host, port), not yet listening; ``setting`` names where the port came from in errors."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers do not count
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OpenAIServerError(f"{setting}: {port} on {host} is in use ({exc.strerror}; another server, or a "
                                f"second `serve --openai`?); stop it or choose a free port with --openai-port or "
                                f"the config's serve.openai_port") from None
    return sock


class OpenAIServer:
    """The endpoint on a reserved socket; start() returns once it accepts connections, stop() ends it."""

    def __init__(self, served: ServedModel, triton_grpc: str, sock: socket.socket):
        self.sock = sock
        host, port = sock.getsockname()[:2]
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # a wildcard address is reached via loopback
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"  # what a local client uses
        config = uvicorn.Config(create_app(served, triton_grpc), http="h11", loop="asyncio", lifespan="on",
                                log_level="warning", access_log=False, timeout_graceful_shutdown=GRACEFUL_STOP_S)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> OpenAIServer:
        # uvicorn installs no signal handlers off the main thread: serve's own handlers stay in charge.
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.sock]}, name="openai-api",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise OpenAIServerError(f"the OpenAI-compatible endpoint on {self.url} did not start (see the "
                                        f"uvicorn messages above)")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Stop accepting, give open requests GRACEFUL_STOP_S, then end; the port is free afterwards."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(GRACEFUL_STOP_S + 5)
            self._thread = None
        self.sock.close()

    def kill(self) -> None:
        """End at once, open streams cut (a second Ctrl-C); stop() then returns quickly."""
        self._server.force_exit = True
        self._server.should_exit = True
