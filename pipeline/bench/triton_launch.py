"""Start a real tritonserver on free loopback ports for bench-serve's Triton paths."""

from __future__ import annotations


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (another process may take it first; rare on loopback)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def start_triton(config, engines_dir, log_path):
    """Deploy the engines and start tritonserver on free loopback ports; the caller stops it. The benchmark's own
    server exports the prefix-cache counters (its hit rate is one of the figures); its clients are the benchmark's."""
    from ..triton.repository import deploy
    from ..triton.server import Endpoints, TritonServer

    config = config.model_copy(update={"serve": config.serve.model_copy(update={"prefix_cache_metrics": True})})
    repo = deploy(config, engines_dir).path
    endpoints = Endpoints("127.0.0.1", free_port(), free_port(), free_port())
    return TritonServer(repo, endpoints, log_path=log_path).start(ready_timeout_s=400)
