"""pipeline/front/http_server.py: a live HttpFront on loopback with a small Starlette app. Slow and half-open
connections are closed after the read timeout, connections past the limit get a 503 at once, an abandoned upload
prints no traceback, and drain() lets running requests finish, tells the app when its deadline passes, and cuts
what still runs after the grace."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("uvicorn")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from pipeline.front.http_server import HttpFront, drain_deadline, reserve_port  # noqa: E402


def error_body(status: int, message: str) -> dict:
    return {"error": {"status": status, "message": message}}


async def ok(request: Request):
    await asyncio.sleep(float(request.query_params.get("wait", 0)))
    return JSONResponse({"ok": True})


async def upload(request: Request):
    return JSONResponse({"bytes": len(await request.body())})


async def events(request: Request):
    """n events step_s apart; at the drain deadline an error event, then the end marker, as an SSE app does."""
    count, step_s = int(request.query_params["n"]), float(request.query_params.get("step", 0.1))
    deadline = drain_deadline(request.scope)

    async def stream():
        for i in range(count):
            sleep = asyncio.ensure_future(asyncio.sleep(step_s))
            ended = asyncio.ensure_future(deadline.wait())
            await asyncio.wait({sleep, ended}, return_when=asyncio.FIRST_COMPLETED)
            sleep.cancel()
            ended.cancel()
            if deadline.is_set():
                yield b'data: {"error": "shutting down"}\n\n'
                break
            yield f"data: {i}\n\n".encode()
        yield b"data: [END]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")


async def stubborn(request: Request):
    async def stream():
        yield b"data: started\n\n"
        await asyncio.sleep(3600)  # ignores the drain deadline

    return StreamingResponse(stream(), media_type="text/event-stream")


APP = Starlette(routes=[Route("/ok", ok), Route("/upload", upload, methods=["POST"]), Route("/events", events),
                        Route("/stubborn", stubborn)])


def start(**options) -> HttpFront:
    sock = reserve_port("127.0.0.1", 0, "test.port", "pick another")
    return HttpFront(APP, sock, name="test-front", error_body=error_body, **options).start()


def port_of(front: HttpFront) -> int:
    return int(front.url.rsplit(":", 1)[1])


def get(front: HttpFront, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(front.url + path, timeout=30) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def until_closed(sock: socket.socket, limit_s: float = 10.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took (limit_s at most)."""
    sock.settimeout(limit_s)
    began, received = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        pass
    return received, time.monotonic() - began


@pytest.mark.parametrize("sent, answer", [
    (b"", b""),  # connected, said nothing: closed silently
    (b"GET /ok HTTP/1.1\r\nHost: x\r\n", b"HTTP/1.1 408 "),  # headers never finished
    (b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789", b"HTTP/1.1 408 "),  # body
], ids=["nothing", "half-headers", "half-body"])
def test_a_request_not_delivered_within_the_read_timeout_is_closed(sent, answer):
    front = start(read_timeout_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", port_of(front))) as sock:
            sock.sendall(sent)
            received, took = until_closed(sock)
        assert took < 8 and received.startswith(answer), (took, received)
        if answer:
            assert json.loads(received.split(b"\r\n\r\n", 1)[1])["error"]["message"].startswith("request: headers "
                                                                                                 "and body did not")
        # a slow answer is not a slow request: the timer stops once the request is in
        assert get(front, "/ok?wait=1.5") == (200, b'{"ok":true}')
    finally:
        front.kill()
        front.stop()


def test_many_half_open_connections_are_all_closed():
    front = start(read_timeout_s=0.5)
    try:
        sockets = [socket.create_connection(("127.0.0.1", port_of(front))) for _ in range(50)]
        for sock in sockets:
            sock.sendall(b"GET /ok HTTP/1.1\r\n")
        assert all(until_closed(sock)[1] < 8 for sock in sockets)
        for sock in sockets:
            sock.close()
        assert get(front, "/ok")[0] == 200
    finally:
        front.stop()


def test_past_the_connection_limit_a_request_gets_503_at_once():
    front = start(max_connections=2, read_timeout_s=60)
    try:
        idle = [socket.create_connection(("127.0.0.1", port_of(front))) for _ in range(2)]
        time.sleep(0.2)  # the server has accepted them
        status, body = get(front, "/ok")
        assert status == 503 and "limit of 2 open connections" in json.loads(body)["error"]["message"]
        # past twice the limit a connection is closed unanswered: a flood cannot hold file descriptors
        idle += [socket.create_connection(("127.0.0.1", port_of(front))) for _ in range(2)]
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port_of(front))) as flood:
            received, took = until_closed(flood, limit_s=5)
            assert (received, took < 4) == (b"", True)
        for sock in idle:
            sock.close()
        time.sleep(0.2)
        assert get(front, "/ok")[0] == 200
    finally:
        front.stop()


class recorded:  # noqa: N801 - used like a function
    """The records of these loggers from now until stop() (uvicorn's loggers do not propagate to pytest's
    capture); start the server first: uvicorn's logging setup replaces the handlers of its loggers."""

    def __init__(self, *names: str):
        self.records: list[logging.LogRecord] = []
        self.handler = logging.Handler()
        self.handler.emit = self.records.append
        self.loggers = [logging.getLogger(name) for name in names]
        for logger in self.loggers:
            logger.addHandler(self.handler)

    def stop(self) -> None:
        for logger in self.loggers:
            logger.removeHandler(self.handler)


def test_an_upload_abandoned_mid_body_logs_no_traceback():
    front = start()
    log = recorded("uvicorn.error")
    try:
        with socket.create_connection(("127.0.0.1", port_of(front))) as sock:
            sock.sendall(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n0123456789")
            time.sleep(0.3)
        time.sleep(0.5)
        assert get(front, "/ok")[0] == 200
    finally:
        front.stop()
        log.stop()
    assert [r.getMessage() for r in log.records if r.levelno >= logging.WARNING or r.exc_info] == []


def stream(front: HttpFront, path: str, into: dict, key: str) -> None:
    try:
        with urllib.request.urlopen(front.url + path, timeout=60) as answer:
            into[key] = answer.read().decode()
    except urllib.error.HTTPError as exc:
        into[key] = (exc.code, exc.read().decode())
    except (OSError, http.client.HTTPException) as exc:  # cut mid-body
        into[key] = exc


def test_drain_lets_running_requests_finish_then_ends_the_rest_through_the_app():
    front = start(end_grace_s=5)
    port = port_of(front)
    got: dict = {}
    threads = [threading.Thread(target=stream, args=(front, path, got, key)) for key, path in
               [("short", "/events?n=5&step=0.1"), ("long", "/events?n=1000&step=0.1")]]
    for thread in threads:
        thread.start()
    time.sleep(0.3)  # both have started
    late = threading.Timer(0.3, stream, args=(front, "/ok", got, "late"))
    late.start()
    began = time.monotonic()
    front.drain(1.5)
    took = time.monotonic() - began
    for thread in [*threads, late]:
        thread.join(30)
    assert 1.0 < took < 8, took
    assert got["short"].endswith("data: 3\n\ndata: 4\n\ndata: [END]\n\n")  # finished within the drain time
    assert got["long"].endswith('data: {"error": "shutting down"}\n\ndata: [END]\n\n'), got["long"][-200:]
    assert got["late"][0] == 503 and "shutting down" in json.loads(got["late"][1])["error"]["message"]
    reserve_port("127.0.0.1", port, "test.port", "-").close()  # the port is free again
    front.drain(1)  # a second drain (or stop) is harmless
    front.stop()


def test_drain_cuts_what_ignores_the_deadline_after_the_grace():
    front = start(end_grace_s=0.5)
    log = recorded("uvicorn.error", "pipeline.front.http_server")
    got: dict = {}
    thread = threading.Thread(target=stream, args=(front, "/stubborn", got, "stubborn"))
    thread.start()
    time.sleep(0.3)
    began = time.monotonic()
    try:
        front.drain(0.5)
    finally:
        log.stop()
    assert time.monotonic() - began < 6
    thread.join(30)
    assert not thread.is_alive() and isinstance(got["stubborn"], Exception)  # cut, as nothing else would end it
    # one line for the cut request, no traceback
    assert [(r.levelno, r.getMessage()) for r in log.records if r.levelno >= logging.WARNING or r.exc_info] == [
        (logging.WARNING, "test-front: cut GET /stubborn, still running when the server stopped")]


def test_kill_ends_a_drain_in_progress_at_once():
    front = start()
    got: dict = {}
    client = threading.Thread(target=stream, args=(front, "/stubborn", got, "stubborn"))
    client.start()
    time.sleep(0.3)
    drain = threading.Thread(target=front.drain, args=(600,))
    drain.start()
    time.sleep(0.5)
    assert drain.is_alive()  # waiting for the stubborn stream
    began = time.monotonic()
    front.kill()
    drain.join(15)
    assert not drain.is_alive() and time.monotonic() - began < 10
    client.join(15)
    assert not client.is_alive()
