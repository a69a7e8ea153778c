"""Clients that go away stop costing compute: dropped HTTP streams, cancelled gRPC streams and cancelled gRPC
requests to the request/response model all end their engine request within a step or so (issue: cancelled
clients used to be generated to max_tokens)."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request

import numpy as np
import pytest

from pipeline.config import load_config
from pipeline.triton.repository import deploy
from pipeline.triton.server import Endpoints, TritonServer
from triton_helpers import free_port

pytestmark = pytest.mark.server
MAX_TOKENS = 400  # an uncancelled request finishes all of these within a few seconds on this pair


@pytest.fixture(scope="module")
def server(built_engines, tmp_path_factory):
    config_path, engines = built_engines
    repo = deploy(load_config(config_path), engines).path
    endpoints = Endpoints("127.0.0.1", free_port(), free_port(), free_port())
    log = tmp_path_factory.mktemp("triton-cancel") / "server.log"
    running = TritonServer(repo, endpoints, log_path=log).start(ready_timeout_s=400)
    try:
        yield running
    finally:
        running.stop()


def metric(server, name: str, model: str = "speculative_stream", extra: str = "") -> float:
    with urllib.request.urlopen(server.endpoints.metrics_url, timeout=30) as response:
        text = response.read().decode()
    pattern = rf'^{name}{{(?=[^}}]*model="{model}")(?=[^}}]*{extra})[^}}]*}} (\S+)$'
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


def generated(server) -> float:
    """Tokens the engine model has generated so far (its own counter, proxied requests included)."""
    return metric(server, "spec_generated_tokens_total")


def cancelled(server, model: str = "speculative_stream") -> float:
    return metric(server, "spec_requests_total", model, 'outcome="cancelled"')


def settled(server, timeout: float = 20.0) -> float:
    """The counter once it stops moving (all engine work for earlier requests has ended)."""
    last, deadline = generated(server), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = generated(server)
        if now == last:
            return now
        last = now
    return last


def grpc_inputs(module, prompt: str, max_tokens: int):
    text = module.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[prompt.encode()]], dtype=np.object_))
    count = module.InferInput("max_tokens", [1, 1], "INT32")
    count.set_data_from_numpy(np.array([[max_tokens]], dtype=np.int32))
    return [text, count]


def test_dropped_http_streams_stop_generating(server):
    before, cancels = settled(server), cancelled(server)
    host, port = server.endpoints.http.split(":")
    body = json.dumps({"text_input": "def f(x):", "max_tokens": MAX_TOKENS}).encode()
    for _ in range(5):
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(b"POST /v2/models/speculative_stream/generate_stream HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            assert conn.recv(200)  # the first step's response arrived; then the client hangs up
    spent = settled(server) - before
    assert spent < 0.5 * 5 * MAX_TOKENS, spent
    assert cancelled(server) - cancels == 5


def test_cancelled_grpc_stream_and_request_stop_generating(server):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.endpoints.grpc)
    # Tokens are cheap on this pair, so the checks are: the engine counted a cancellation, and the request
    # ended short of its max_tokens.
    before, cancels = settled(server), cancelled(server)
    client.start_stream(callback=lambda result, error: None)
    client.async_stream_infer("speculative_stream", grpc_inputs(grpcclient, "def g(y):", MAX_TOKENS))
    time.sleep(0.05)
    client.stop_stream(cancel_requests=True)
    streamed = settled(server) - before
    assert streamed < MAX_TOKENS and cancelled(server) - cancels == 1, streamed

    before, cancels = settled(server), cancelled(server)
    proxy_cancels = cancelled(server, "speculative")
    future = client.async_infer("speculative", grpc_inputs(grpcclient, "class A:", MAX_TOKENS),
                                callback=lambda result, error: None)
    time.sleep(0.05)
    future.cancel()  # the proxy sees its request cancelled and cancels the engine request it forwarded
    unary = settled(server) - before
    assert unary < MAX_TOKENS and cancelled(server) - cancels == 1, unary
    assert cancelled(server, "speculative") - proxy_cancels == 1

    # the server is unharmed: a normal request right after gets its full answer
    result = client.infer("speculative", grpc_inputs(grpcclient, "def h(z):", 8))
    assert len(result.as_numpy("output_ids")[0]) == 8
