"""pipeline/front/grpc_proxy.py: the gRPC front in front of a fake upstream (a generic gRPC server on loopback that
echoes bytes and the metadata it got). Calls without the key are refused before they reach the upstream; with it,
unary and streaming calls pass unchanged, less the key; upstream errors pass with their status; a client that goes
away cancels its forwarded stream."""

from __future__ import annotations

import queue
import threading
import time
from concurrent import futures

import grpc
import pytest

from pipeline.front.grpc_proxy import STREAMING_METHODS, GrpcFront, bearer_ok
from tests.triton_helpers import free_port

UNARY = "/inference.GRPCInferenceService/ModelInfer"
STREAM = next(iter(STREAMING_METHODS))
KEY = "k-123"


class Upstream(grpc.GenericRpcHandler):
    def __init__(self):
        self.metadata: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()

    def service(self, details):
        self.metadata.put(dict(details.invocation_metadata))
        if details.method == STREAM:
            return grpc.stream_stream_rpc_method_handler(self._stream)
        return grpc.unary_unary_rpc_method_handler(self._unary)

    def _unary(self, request: bytes, context) -> bytes:
        if request == b"fail":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: -1 must be >= 0")
        return request[::-1]

    def _stream(self, requests, context):
        context.add_callback(self.cancelled.set)
        for request in requests:
            for i in range(int(request)):
                if not context.is_active():
                    return
                yield str(i).encode()
                time.sleep(0.02)


@pytest.fixture
def front():
    upstream = Upstream()
    server = grpc.server(futures.ThreadPoolExecutor(8), handlers=[upstream])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    front = GrpcFront("127.0.0.1", free_port(), f"127.0.0.1:{port}", KEY, max_connections=8).start()
    channel = grpc.insecure_channel(front.address)
    yield front, upstream, channel
    channel.close()
    front.stop()
    server.stop(0)


def test_bearer_check():
    assert bearer_ok([("authorization", f"Bearer {KEY}")], KEY)
    for metadata in ([], [("authorization", KEY)], [("authorization", "Bearer k-12")], [("x", f"Bearer {KEY}")]):
        assert not bearer_ok(metadata, KEY), metadata


def test_calls_without_the_key_never_reach_the_upstream(front):
    _, upstream, channel = front
    for metadata in (None, [("authorization", "Bearer wrong")]):
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary(UNARY)(b"abc", metadata=metadata, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as refused:
            list(channel.stream_stream(STREAM)(iter([b"3"]), metadata=metadata, timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert upstream.metadata.empty()


def test_calls_with_the_key_pass_unchanged_less_the_key(front):
    _, upstream, channel = front
    key = [("authorization", f"Bearer {KEY}"), ("triton-grpc-error", "true")]
    assert channel.unary_unary(UNARY)(b"abc", metadata=key, timeout=10) == b"cba"
    seen = upstream.metadata.get(timeout=5)
    assert seen["triton-grpc-error"] == "true" and "authorization" not in seen
    assert list(channel.stream_stream(STREAM)(iter([b"4"]), metadata=key, timeout=10)) == [b"0", b"1", b"2", b"3"]
    with pytest.raises(grpc.RpcError) as failed:
        channel.unary_unary(UNARY)(b"fail", metadata=key, timeout=10)
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in failed.value.details()


def test_a_client_that_goes_away_cancels_its_forwarded_stream(front):
    _, upstream, channel = front
    call = channel.stream_stream(STREAM)(iter([b"100000"]), metadata=[("authorization", f"Bearer {KEY}")])
    assert next(call) == b"0"
    call.cancel()
    assert upstream.cancelled.wait(10)
