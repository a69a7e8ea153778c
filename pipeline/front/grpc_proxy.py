"""A gRPC front for tritonserver: every call forwarded to Triton's own gRPC port, after an API key check.

Triton takes its gRPC restriction keys only on its command line, where every local user reads them, so when serve
has an API key its Triton listens on loopback and this front holds the public gRPC port instead. Messages are
forwarded as bytes (no decoding), so every method of Triton's GRPCInferenceService works unchanged, the streaming
one included; a client that goes away cancels its forwarded call.
"""

from __future__ import annotations

import hmac
from concurrent import futures

import grpc

STREAMING_METHODS = frozenset({"/inference.GRPCInferenceService/ModelStreamInfer"})
# Triton's own message limits (tritonclient sets the same on its channels).
MESSAGE_LIMITS = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)]
# Not forwarded: the caller's key is for this front (Triton never sees it), and what gRPC sets on every call itself.
DROPPED_METADATA = frozenset({"authorization", "user-agent", "te", "content-type"})


def bearer_ok(metadata, api_key: str) -> bool:
    """Whether the call's metadata carries ``authorization: Bearer <api_key>`` (compared in constant time)."""
    given = next((value for key, value in metadata if key == "authorization"), None)
    if not isinstance(given, str) or not given.startswith("Bearer "):
        return False
    return hmac.compare_digest(given[len("Bearer "):].encode(), api_key.encode())


class _Forward(grpc.GenericRpcHandler):
    def __init__(self, channel: grpc.Channel, api_key: str | None):
        self.channel = channel
        self.api_key = api_key

    def service(self, details: grpc.HandlerCallDetails):
        if self.api_key is not None and not bearer_ok(details.invocation_metadata, self.api_key):
            return grpc.unary_unary_rpc_method_handler(_unauthenticated) if details.method not in \
                STREAMING_METHODS else grpc.stream_stream_rpc_method_handler(_unauthenticated)
        metadata = [(key, value) for key, value in details.invocation_metadata
                    if key not in DROPPED_METADATA and not key.startswith(("grpc-", ":"))]
        if details.method in STREAMING_METHODS:
            return grpc.stream_stream_rpc_method_handler(self._stream(details.method, metadata))
        return grpc.unary_unary_rpc_method_handler(self._unary(details.method, metadata))

    def _unary(self, method: str, metadata):
        call = self.channel.unary_unary(method)

        def forward(request: bytes, context: grpc.ServicerContext) -> bytes:
            try:
                return call(request, metadata=metadata, timeout=_deadline(context))
            except grpc.RpcError as exc:
                context.abort(exc.code(), exc.details() or "")

        return forward

    def _stream(self, method: str, metadata):
        call = self.channel.stream_stream(method)

        def forward(requests, context: grpc.ServicerContext):
            responses = call(requests, metadata=metadata, timeout=_deadline(context))
            context.add_callback(responses.cancel)  # the client went away: Triton cancels the request
            try:
                yield from responses
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    context.abort(exc.code(), exc.details() or "")

        return forward


def _deadline(context: grpc.ServicerContext) -> float | None:
    """The caller's deadline, passed on; None when it set none (gRPC reports that as ~2**63 seconds)."""
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining < 1e9 else None


def _unauthenticated(request, context: grpc.ServicerContext):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key: send the metadata "
                                                   "`authorization: Bearer <key>` (serve.api_key_env)")


class GrpcFront:
    """The front on ``bind_address:port`` forwarding to ``upstream`` (host:port); start() then stop()."""

    def __init__(self, bind_address: str, port: int, upstream: str, api_key: str | None, max_connections: int):
        self.address = f"{bind_address}:{port}"
        self.upstream = upstream
        self._channel = grpc.insecure_channel(upstream, options=MESSAGE_LIMITS)
        # One thread per call in flight (a stream holds its thread): the pool is the concurrency limit.
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_connections,
                                                              thread_name_prefix="grpc-front"),
                                   handlers=[_Forward(self._channel, api_key)], options=MESSAGE_LIMITS,
                                   maximum_concurrent_rpcs=max_connections)

    def start(self) -> GrpcFront:
        if self._server.add_insecure_port(self.address) == 0:
            raise OSError(f"serve.grpc_port: cannot listen on {self.address} (in use?)")
        self._server.start()
        return self

    def drain(self, timeout_s: float) -> None:
        """New calls are refused at once; calls in flight get ``timeout_s`` to finish, then are cancelled (their
        clients get status CANCELLED, and Triton cancels the forwarded requests)."""
        self._server.stop(timeout_s).wait()
        self._channel.close()

    def stop(self) -> None:
        self.drain(0)

    def kill(self) -> None:
        """Cancel every call now; returns without waiting (a signal handler may call it)."""
        self._server.stop(None)
