"""serve's public listeners, in front of a tritonserver that listens on loopback.

- HTTP (serve.http_port): Triton's HTTP/REST API through pipeline/front/triton_http.py, behind the Guard (Host
  check, CORS off unless origins are listed, no cross-site "simple" bodies, the API key) with a read deadline and a
  connection limit. Triton's own HTTP port is a loopback port that answers only its exact Host name.
- gRPC (serve.grpc_port): Triton's gRPC API through pipeline/front/grpc_proxy.py (the API key, a concurrency
  limit, drain); Triton's own gRPC port is on loopback.
- OpenAI (serve.openai_port, with --openai): the OpenAI-compatible app, a gRPC client of Triton.
- metrics (serve.metrics_port): Triton's own, read-only.

Every public socket is bound before tritonserver starts, so a port in use fails at once, and Triton keeps the same
loopback ports across restarts after a crash. Every client request passes a front, so a drain of the fronts is a
drain of the server: Triton counts a decoupled model's stream as finished once the request is handed over, and its
own SIGTERM handling would cut streams that are still generating.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..config import PipelineConfig
from ..errors import BackendUnavailable, PipelineError
from .server import Endpoints

HEALTH_PATHS = ("/v2/health",)  # open without the API key: load balancers' readiness probes
LOOPBACK = "127.0.0.1"


def load_api_key(config: PipelineConfig, key_file: Path | None, env: dict[str, str] | None = None) -> str | None:
    """The API key from --api-key-file, else from the variable serve.api_key_env names, else None."""
    env = os.environ if env is None else env
    if key_file is not None:
        try:
            mode = key_file.stat().st_mode
            key = key_file.read_text().strip()
        except OSError as exc:
            raise PipelineError(f"--api-key-file {key_file}: cannot read it ({exc.strerror})") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise PipelineError(f"--api-key-file {key_file}: readable by other users (mode {stat.S_IMODE(mode):o}); "
                                f"run `chmod 600 {key_file}`")
        if not key:
            raise PipelineError(f"--api-key-file {key_file}: empty; write the key on its first line")
        return key
    name = config.serve.api_key_env
    if name is None:
        return None
    key = env.get(name, "").strip()
    if not key:
        raise PipelineError(f"serve.api_key_env: the environment variable {name} is not set or empty; export the "
                            f"key in it (e.g. `export {name}=$(python -c 'import secrets; "
                            f"print(secrets.token_urlsafe(32))')`) or remove serve.api_key_env")
    return key


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def openai_server(config: PipelineConfig, engines_dir: Path, triton_grpc: str, sock: socket.socket, guard=None):
    """The OpenAI-compatible endpoint (not started) for a built config's engines, a gRPC client of ``triton_grpc``,
    with the limits of the config's serve section (``guard`` None: loopback Host names, no key)."""
    from ..engine_info import read_engine
    from ..layout import Layout
    from ..openai_api.protocol import ServedModel
    from ..openai_api.server import OpenAIServer
    from .request_inputs import max_prompt_bytes

    s = config.serve
    root = Layout.for_config(config, engines_dir).root
    target = read_engine(root, "target")
    served = ServedModel(config.name, target.max_seq_len, target.max_input_len, max_prompt_bytes(target.max_input_len),
                         tool_format=served_tool_format(Layout(root).engine_dir("target")))
    return OpenAIServer(served, triton_grpc, sock, guard=guard, request_timeout_s=s.request_timeout_s,
                        max_connections=s.max_connections, read_timeout_s=s.read_timeout_s)


def served_tool_format(engine_dir: Path) -> str | None:
    """How the target's chat template writes tool calls (None: no template, or one without tools)."""
    from transformers import AutoTokenizer

    from ..chat import chat_tool_format

    try:
        tokenizer = AutoTokenizer.from_pretrained(engine_dir)
    except (OSError, ValueError):  # an engine without a tokenizer serves token ids only
        return None
    return chat_tool_format(tokenizer)


@dataclass
class Fronts:
    """The public listeners of one `serve`; reserve() binds them, start() serves, drain()/kill() end them."""

    config: PipelineConfig
    api_key: str | None
    openai_port: int | None  # None: no OpenAI endpoint
    triton_endpoints: Endpoints = field(init=False)
    _http_socket: socket.socket | None = field(default=None, init=False, repr=False)
    _openai_socket: socket.socket | None = field(default=None, init=False, repr=False)
    _started: list = field(default_factory=list, init=False, repr=False)

    def reserve(self) -> Fronts:
        """Bind the public ports (nothing listens yet) and choose Triton's loopback ports."""
        try:
            from ..front.http_server import reserve_port
            import aiohttp  # noqa: F401 - the HTTP front's client
            import grpc  # noqa: F401 - the gRPC front
        except ImportError as exc:
            raise BackendUnavailable(f"serve: {exc.name} is not installed; run `pip install -e '.[serve]'` or "
                                     f"`make setup`") from None

        s = self.config.serve
        fix = "stop it or choose free ports in the config's serve section"
        self._http_socket = reserve_port(s.bind_address, s.http_port, "serve.http_port", fix)
        if self.openai_port is not None:
            from ..openai_api.server import reserve_port as reserve_openai

            self._openai_socket = reserve_openai(s.bind_address, self.openai_port,
                                                 "serve.openai_port" if self.openai_port == s.openai_port
                                                 else "--openai-port")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:  # grpc binds later, by itself
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((s.bind_address, s.grpc_port))
            except OSError as exc:
                raise PipelineError(f"serve.grpc_port: {s.grpc_port} on {s.bind_address} is in use ({exc.strerror}); "
                                    f"{fix}") from None
        self.triton_endpoints = Endpoints(s.bind_address, free_loopback_port(), free_loopback_port(), s.metrics_port,
                                          http_host=LOOPBACK, grpc_host=LOOPBACK)
        return self

    def guard(self, port: int, body: str, open_paths: tuple[str, ...] = ()):
        from ..front.guard import GuardSettings, allowed_hosts_for

        s = self.config.serve
        return GuardSettings(allowed_hosts_for(s.bind_address, port, s.allowed_hosts), tuple(s.allowed_origins),
                             self.api_key, body, open_paths)

    def start(self, engines_dir: Path) -> list[str]:
        """Serve on the reserved sockets (tritonserver is up); returns one line per endpoint for the user."""
        from ..front.grpc_proxy import GrpcFront
        from ..front.guard import Guard
        from ..front.http_server import HttpFront, plain_error_body
        from ..front.triton_http import TritonHttpFront

        s = self.config.serve
        app = Guard(TritonHttpFront(self.triton_endpoints.http), self.guard(s.http_port, "not-simple", HEALTH_PATHS),
                    plain_error_body)
        http = HttpFront(app, self._http_socket, name="triton-http", max_connections=s.max_connections,
                         read_timeout_s=s.read_timeout_s)
        self._started.append(http.start())
        lines = [f"HTTP {http.url}"]
        grpc = GrpcFront(s.bind_address, s.grpc_port, self.triton_endpoints.grpc, self.api_key, s.max_connections)
        self._started.append(grpc.start())
        lines.append(f"gRPC {_reachable(s.bind_address)}:{s.grpc_port}")
        lines.append(f"metrics {self.triton_endpoints.metrics_url}")
        if self._openai_socket is not None:
            lines.append(f"OpenAI-compatible: {self._start_openai(engines_dir)}  (model {self.config.name!r}: "
                         f"/models, /completions, /chat/completions)")
        return lines

    def _start_openai(self, engines_dir: Path) -> str:
        openai = openai_server(self.config, engines_dir, self.triton_endpoints.grpc, self._openai_socket,
                               guard=self.guard(self.openai_port, "json"))
        self._started.append(openai.start())
        return openai.url

    def drain(self, timeout_s: float) -> None:
        """Every front at once: new requests refused, running ones get ``timeout_s``, then end with an error."""
        threads = [threading.Thread(target=front.drain, args=(timeout_s,), daemon=True) for front in self._started]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self._started.clear()
        self.close()

    def kill(self) -> None:
        for front in self._started:
            front.kill()

    def close(self) -> None:
        """Release sockets that were reserved but never served (a start that failed)."""
        for sock in (self._http_socket, self._openai_socket):
            if sock is not None:
                sock.close()


def _reachable(host: str) -> str:
    return LOOPBACK if host in ("0.0.0.0", "") else host
