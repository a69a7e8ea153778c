"""serve's HTTP front for tritonserver: Triton's HTTP/REST API on the public port, forwarded to Triton on loopback.

Triton's HTTP server has no Host check (a web page that rebinds a name of its own to 127.0.0.1 reads its answers),
no API key that stays out of argv, no read timeout and no connection limit. serve therefore runs Triton's HTTP on a
loopback port that answers only requests naming it exactly in their Host header, and puts this app, wrapped in the
shared Guard, on the port clients use. Requests and responses pass through unchanged (binary tensor bodies,
``generate_stream`` server-sent events as they come), less the hop-by-hop headers and the caller's key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp

from .http_server import drain_deadline

# Headers that describe one connection, not the message (RFC 9110 7.6.1), plus the ones this front sets itself.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length", "authorization", "origin",
                        "expect"})
# Triton 2.51 crashes on JSON request bodies of a few MB; nothing this server takes needs more than this.
MAX_BODY_BYTES = 2 * 1024 * 1024


def triton_error(status: int, message: str) -> dict:
    """Triton's own error body."""
    return {"error": message}


class TritonHttpFront:
    """ASGI app forwarding every HTTP request to Triton's HTTP at ``upstream`` (host:port)."""

    def __init__(self, upstream: str, max_body_bytes: int = MAX_BODY_BYTES, timeout_s: float | None = None):
        self.upstream = f"http://{upstream}"
        self.max_body_bytes = max_body_bytes
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, connect=10)
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._forward(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                # No pooling limit of its own: the front's connection limit bounds the requests in flight.
                self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._session is not None:
                    await self._session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _forward(self, scope, receive, send) -> None:
        body = await self._body(receive)
        if body is None:
            await _reply(send, 413, f"request body: over the {self.max_body_bytes}-byte limit of this server")
            return
        path = scope.get("raw_path") or scope["path"].encode()
        url = self.upstream + path.decode("latin-1") + ("?" + scope["query_string"].decode("latin-1")
                                                         if scope.get("query_string") else "")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k.decode("latin-1").lower() not in HOP_BY_HOP]
        try:
            async with self._session.request(scope["method"], url, data=body, headers=headers, timeout=self.timeout,
                                             allow_redirects=False) as upstream:
                await send({"type": "http.response.start", "status": upstream.status,
                            "headers": [(k.encode("latin-1"), v.encode("latin-1"))
                                        for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP]})
                await _relay(upstream, send, drain_deadline(scope))
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            # Before the status went out: a clean 502/504. After it, the connection is cut (the body is partial).
            status = 504 if isinstance(exc, TimeoutError) else 502
            await _reply(send, status, f"tritonserver did not answer ({type(exc).__name__}: {exc}); if serve is "
                                       f"restarting it after a crash, retry shortly")

    async def _body(self, receive) -> bytes | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b""
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def _relay(upstream: aiohttp.ClientResponse, send, deadline: asyncio.Event) -> None:
    """The response body as it comes; a stream still running when serve's drain deadline passes ends with an error
    event, as Triton's generate_stream reports errors, instead of being cut."""
    stream = upstream.headers.get("content-type", "").startswith("text/event-stream")
    # A plain response is one JSON body: half of one is worse than the cut the front makes after its grace time.
    ended = asyncio.ensure_future(deadline.wait() if stream else asyncio.Event().wait())
    try:
        while True:
            chunk = asyncio.ensure_future(upstream.content.readany())
            await asyncio.wait({chunk, ended}, return_when=asyncio.FIRST_COMPLETED)
            if not chunk.done():
                chunk.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await chunk
                if stream:
                    event = json.dumps(triton_error(503, "the server is shutting down; retry on another replica or "
                                                         "once it is back"))
                    await send({"type": "http.response.body", "body": f"data: {event}\n\n".encode(),
                                "more_body": True})
                break
            data = chunk.result()
            if not data:
                break
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    finally:
        ended.cancel()


async def _reply(send, status: int, message: str) -> None:
    body = json.dumps(triton_error(status, message)).encode()
    try:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
    except (RuntimeError, OSError):  # the response had started, or the client is gone: nothing more to say
        pass
