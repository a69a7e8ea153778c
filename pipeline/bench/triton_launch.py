"""Start a real tritonserver on free loopback ports for bench-serve's Triton paths, and the OpenAI-compatible
endpoint in front of it for its openai path."""

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


def start_openai(config, engines_dir, triton_grpc: str):
    """The OpenAI-compatible endpoint on a free loopback port, a gRPC client of ``triton_grpc``, as `serve --openai`
    starts it (the same limits from the config's serve section); the caller stops it."""
    from ..openai_api.server import reserve_port
    from ..triton.fronts import openai_server

    sock = reserve_port("127.0.0.1", free_port(), "--paths openai")
    return openai_server(config, engines_dir, triton_grpc, sock).start()
