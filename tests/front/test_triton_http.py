"""pipeline/front/triton_http.py: the HTTP front forwards Triton's API unchanged, less the caller's key and the
hop-by-hop headers (upstream: a small Starlette app standing in for tritonserver, both on loopback). Streams pass
as they come and end with an error event at the drain deadline; a body over the limit never reaches the upstream;
an upstream that is gone is a 502, not a hang."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import pytest

pytest.importorskip("aiohttp")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, Response, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from pipeline.front.http_server import HttpFront, reserve_port  # noqa: E402
from pipeline.front.triton_http import TritonHttpFront  # noqa: E402

SEEN: list[dict] = []


async def echo(request: Request):
    body = await request.body()
    SEEN.append({"method": request.method, "path": request.url.path, "query": request.url.query,
                 "headers": dict(request.headers), "body": body})
    return Response(body[::-1], status_code=201, media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": "7"})


async def stream(request: Request):
    async def events():
        for i in range(int(request.query_params["n"])):
            yield f"data: {i}\n\n".encode()
            await asyncio.sleep(float(request.query_params.get("step", 0.05)))

    return StreamingResponse(events(), media_type="text/event-stream")


UPSTREAM = Starlette(routes=[Route("/v2/models/m/generate", echo, methods=["POST"]),
                             Route("/v2/models/m/generate_stream", stream, methods=["POST"]),
                             Route("/v2/health/ready", lambda r: JSONResponse({}))])


def serve(app, name: str, **options) -> HttpFront:
    return HttpFront(app, reserve_port("127.0.0.1", 0, "test.port", "pick another"), name=name, **options).start()


@pytest.fixture(scope="module")
def upstream():
    front = serve(UPSTREAM, "fake-triton")
    yield front
    front.kill()
    front.stop()


def post(url: str, path: str, body: bytes, headers: dict | None = None):
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", path, body=body, headers=headers or {})
    answer = connection.getresponse()
    data = answer.read()
    connection.close()
    return answer.status, answer.headers, data  # headers: case-insensitive


def test_requests_and_answers_pass_unchanged_less_the_key(upstream):
    front = serve(TritonHttpFront(upstream.url.removeprefix("http://")), "front")
    try:
        body = bytes(range(256)) * 4  # binary tensor data, as tritonclient.http sends
        status, headers, data = post(front.url, "/v2/models/m/generate?x=1", body,
                                     {"Authorization": "Bearer secret", "Inference-Header-Content-Length": "3",
                                      "Content-Type": "application/octet-stream"})
    finally:
        front.stop()
    assert status == 201 and data == body[::-1]
    assert headers["Inference-Header-Content-Length"] == "7"
    seen = SEEN[-1]
    assert seen["path"] == "/v2/models/m/generate" and seen["query"] == "x=1" and seen["body"] == body
    assert seen["headers"]["inference-header-content-length"] == "3"
    assert "authorization" not in seen["headers"]  # the caller's key is for the front, never for Triton
    assert seen["headers"]["host"] == upstream.url.removeprefix("http://")  # Triton's exact-Host check passes


def test_a_body_over_the_limit_never_reaches_the_upstream(upstream):
    front = serve(TritonHttpFront(upstream.url.removeprefix("http://"), max_body_bytes=1000), "front")
    before = len(SEEN)
    try:
        status, _, data = post(front.url, "/v2/models/m/generate", b"x" * 1001)
    finally:
        front.stop()
    assert status == 413 and "1000-byte limit" in json.loads(data)["error"]
    assert len(SEEN) == before


def test_streams_pass_as_they_come_and_end_with_an_error_event_at_the_drain_deadline(upstream):
    front = serve(TritonHttpFront(upstream.url.removeprefix("http://")), "front", end_grace_s=2.0)
    host, port = front.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", "/v2/models/m/generate_stream?n=1000&step=0.05", body=b"{}")
    answer = connection.getresponse()
    assert answer.status == 200
    assert answer.readline() == b"data: 0\n"  # the first event arrives long before the stream ends
    drained = threading.Thread(target=front.drain, args=(0.5,))
    drained.start()
    rest = answer.read().decode()  # ends: the front closed the stream itself
    drained.join(30)
    connection.close()
    events = [line for line in rest.splitlines() if line.startswith("data: ")]
    assert 3 < len(events) < 999
    assert json.loads(events[-1].removeprefix("data: "))["error"].startswith("the server is shutting down")


def test_an_upstream_that_is_gone_is_a_502_at_once(upstream):
    gone = reserve_port("127.0.0.1", 0, "test.port", "pick another")  # bound, never listening
    address = "127.0.0.1:%d" % gone.getsockname()[1]
    front = serve(TritonHttpFront(address), "front")
    try:
        start = time.monotonic()
        status, _, data = post(front.url, "/v2/models/m/generate", b"{}")
    finally:
        front.stop()
        gone.close()
    assert status == 502 and time.monotonic() - start < 10
    assert "tritonserver did not answer" in json.loads(data)["error"]
