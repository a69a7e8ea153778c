"""pipeline/openai_api/server.py and app.py without a tritonserver: the endpoint starts on a reserved socket, answers
every failure with an OpenAI error body (503 while Triton is unreachable, 404/405 for routes, 400/413 for bodies),
and frees its port when stopped."""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from pipeline.front.guard import GuardSettings, allowed_hosts_for  # noqa: E402
from pipeline.openai_api.protocol import ServedModel  # noqa: E402
from pipeline.openai_api.server import OpenAIServer, OpenAIServerError, reserve_port  # noqa: E402
from tests.openai_api.fake_triton import FakeTriton  # noqa: E402
from tests.triton_helpers import free_port  # noqa: E402

SERVED = ServedModel("tiny-chat", max_seq_len=512, max_input_len=256, max_prompt_bytes=32 * 256)


@pytest.fixture(scope="module")
def endpoint():
    """The endpoint in front of a gRPC port nothing listens on."""
    server = OpenAIServer(SERVED, f"127.0.0.1:{free_port()}", reserve_port("127.0.0.1", 0)).start()
    try:
        yield server
    finally:
        server.stop()


def call(url: str, body: bytes | None = None, method: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def error_of(answer: dict) -> dict:
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}, answer
    return answer["error"]


def test_models_are_listed_without_triton(endpoint):
    status, answer = call(f"{endpoint.url}/models")
    assert status == 200 and [m["id"] for m in answer["data"]] == ["tiny-chat"] and answer["object"] == "list"
    assert call(f"{endpoint.url}/models/tiny-chat")[1]["id"] == "tiny-chat"
    status, answer = call(f"{endpoint.url}/models/gpt-4o")
    assert status == 404 and error_of(answer)["code"] == "model_not_found"


@pytest.mark.parametrize("stream", [False, True])
def test_unreachable_triton_is_a_503_even_for_streams(endpoint, stream):
    body = json.dumps({"model": "tiny-chat", "prompt": "x", "stream": stream}).encode()
    status, answer = call(f"{endpoint.url}/completions", body)
    assert status == 503 and error_of(answer)["type"] == "server_error"
    assert "unreachable" in answer["error"]["message"], answer


def test_the_official_client_sees_the_503(endpoint):
    client = openai.OpenAI(base_url=endpoint.url, api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}])
    assert info.value.status_code == 503


def test_a_bad_request_is_refused_before_triton_is_asked(endpoint):
    status, answer = call(f"{endpoint.url}/completions", json.dumps({"prompt": "x", "n": 17}).encode())
    assert status == 400 and error_of(answer)["param"] == "n"  # not the 503 that asking Triton would give


@pytest.mark.parametrize("path, method, status, words", [
    ("/nothing", "GET", 404, "Invalid URL (GET /v1/nothing)"),
    ("/completions", "GET", 405, "GET is not allowed on /v1/completions"),
    ("/chat/completions", "PUT", 405, "PUT is not allowed"),
])
def test_routes(endpoint, path, method, status, words):
    code, answer = call(f"{endpoint.url}{path}", b"{}" if method == "PUT" else None, method)
    assert code == status and words in error_of(answer)["message"]


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "request body: not valid JSON"),
    (b"[" * 20_000 + b"]" * 20_000, 400, "request body: not valid JSON"),
    (b'"prompt"', 400, "expected a JSON object"),
    (json.dumps({"prompt": "x" * (4 * SERVED.max_prompt_bytes + 70_000)}).encode(), 413, "byte limit"),
], ids=["broken", "nested", "not-an-object", "too-large"])
def test_bodies(endpoint, body, status, words):
    code, answer = call(f"{endpoint.url}/completions", body)
    assert code == status and words in error_of(answer)["message"]


def test_a_port_in_use_names_its_setting():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(OpenAIServerError, match=rf"^--openai-port: {port} on 127.0.0.1 is in use"):
            reserve_port("127.0.0.1", port, "--openai-port")


def test_stop_frees_the_port():
    server = OpenAIServer(SERVED, f"127.0.0.1:{free_port()}", reserve_port("127.0.0.1", 0)).start()
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    assert call(f"{server.url}/models")[0] == 200
    server.stop()
    reserve_port("127.0.0.1", port).close()  # free again
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{server.url}/models", timeout=5)


# ---- with a fake Triton (tests/openai_api/fake_triton.py): deadlines, drain, Triton going away, the guard --------

@pytest.fixture(scope="module")
def fake_triton():
    """A fake tritonserver in this process: one token per step, 50 ms apart."""
    fake = FakeTriton(step_s=0.05)
    server, port = fake.serve()
    try:
        yield fake, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def started(triton_url: str, **options) -> OpenAIServer:
    return OpenAIServer(SERVED, triton_url, reserve_port("127.0.0.1", 0), **options).start()


def raw_stream(server: OpenAIServer, max_tokens: int) -> str:
    """A streamed completion's whole body, read as it comes (server-sent events)."""
    body = json.dumps({"prompt": "x", "max_tokens": max_tokens, "stream": True}).encode()
    request = urllib.request.Request(f"{server.url}/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return answer.read().decode()


def ends_in_band(events: str, words: str) -> bool:
    """The stream's last events are an OpenAI error naming ``words``, then [DONE]."""
    *_, error, done, tail = events.split("\n\n")
    return (done, tail) == ("data: [DONE]", "") and words in error_of(json.loads(error[len("data: "):]))["message"]


def test_drain_lets_short_streams_finish_and_ends_long_ones_in_band(fake_triton):
    fake, url = fake_triton
    server = started(url)
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    got: dict = {}

    def official(key: str, max_tokens: int):
        try:
            chunks = list(client.completions.create(model="tiny-chat", prompt="x", max_tokens=max_tokens,
                                                    stream=True))
            got[key] = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        except Exception as exc:  # noqa: BLE001 - which exception it is, is the point
            got[key] = exc

    def raw(key: str, max_tokens: int):
        got[key] = raw_stream(server, max_tokens)

    threads = [threading.Thread(target=official, args=("short", 10)),  # 0.5 s: within the drain time
               threading.Thread(target=official, args=("long", 2000)),  # 100 s: not
               threading.Thread(target=raw, args=("long-raw", 2000))]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    ended_early = fake.ended_early
    began = time.monotonic()
    server.drain(1.5)
    assert time.monotonic() - began < 10
    for thread in threads:
        thread.join(30)
    assert got["short"] == ("a" * 10, "length")
    assert isinstance(got["long"], openai.APIError) and not isinstance(got["long"], openai.APIConnectionError)
    assert "server: shutting down" in str(got["long"])
    assert ends_in_band(got["long-raw"], "server: shutting down")
    deadline = time.monotonic() + 10
    while fake.ended_early < ended_early + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fake.ended_early == ended_early + 2  # both Triton requests were cancelled
    server.stop()


def test_the_request_deadline_ends_requests_and_cancels_them(fake_triton):
    fake, url = fake_triton
    server = started(url, request_timeout_s=1.0)
    ended_early = fake.ended_early
    try:
        began = time.monotonic()
        status, answer = call(f"{server.url}/completions", json.dumps({"prompt": "x", "max_tokens": 2000}).encode())
        assert status == 504 and error_of(answer)["code"] == "timeout" and time.monotonic() - began < 10
        assert "request: not finished within this server's 1 s limit" in answer["error"]["message"]
        assert ends_in_band(raw_stream(server, 2000), "request: not finished within")
        assert call(f"{server.url}/completions", json.dumps({"prompt": "x", "max_tokens": 3}).encode())[0] == 200
    finally:
        server.stop()
    assert fake.ended_early == ended_early + 2


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_triton_going_away_ends_every_request_within_seconds(how):
    """Killed, the gRPC connection resets (503, or in-band in a stream); hung (SIGSTOP), the deadline ends it."""
    triton = subprocess.Popen([sys.executable, "-m", "tests.openai_api.fake_triton", "0.05"], stdout=subprocess.PIPE,
                              text=True)
    server = None
    try:
        server = started(f"127.0.0.1:{int(triton.stdout.readline())}", request_timeout_s=3.0)
        got: dict = {}

        def whole():
            got["whole"] = call(f"{server.url}/completions", json.dumps({"prompt": "x", "max_tokens": 2000}).encode())

        def streamed():
            got["stream"] = raw_stream(server, 2000)

        threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        triton.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        for thread in threads:
            thread.join(20)
        status, answer = got["whole"]
        if how == "killed":
            assert status == 503 and "unreachable" in error_of(answer)["message"]
            assert ends_in_band(got["stream"], "unreachable")
        else:
            assert status == 504 and ends_in_band(got["stream"], "request: not finished within")
    finally:
        triton.kill()
        triton.wait()
        if server is not None:
            server.stop()


def test_the_guard_stands_in_front_of_the_app(fake_triton):
    _, url = fake_triton
    sock = reserve_port("127.0.0.1", 0)
    port = sock.getsockname()[1]
    guard = GuardSettings(allowed_hosts_for("127.0.0.1", port), api_key="the-key")
    server = OpenAIServer(SERVED, url, sock, guard=guard).start()
    try:
        with pytest.raises(openai.AuthenticationError) as info:
            openai.OpenAI(base_url=server.url, api_key="a-guess", max_retries=0).models.list()
        assert info.value.status_code == 401 and "the-key" not in str(info.value.body)
        client = openai.OpenAI(base_url=server.url, api_key="the-key", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny-chat"]
        answer = client.completions.create(model="tiny-chat", prompt="x", max_tokens=2)
        assert answer.choices[0].text == "aa"
        key = {"Authorization": "Bearer the-key"}
        for headers, status, words in [
            ({"Host": "evil.example"}, 421, "Host header: 'evil.example'"),  # DNS rebinding
            ({"Origin": "https://evil.example"}, 403, "Origin header: 'https://evil.example'"),  # cross-site
            ({"Content-Type": "text/plain"}, 415, "Content-Type header: 'text/plain'"),  # a form post
        ]:
            request = urllib.request.Request(f"{server.url}/completions", method="POST",
                                             data=b'{"prompt": "x", "max_tokens": 1}',
                                             headers={"Content-Type": "application/json", **key, **headers})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=30)
            assert refused.value.code == status
            assert error_of(json.loads(refused.value.read()))["message"].startswith(words)
    finally:
        server.stop()


def test_a_request_without_max_tokens_asks_triton_to_fit_it(fake_triton):
    fake, url = fake_triton
    server, step_s = started(url), fake.step_s
    fake.step_s = 0.0  # the fake generates every token it is asked for: 256 of them
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}])
        assert fake.requests[-1]["max_tokens_fit"] == [True] and fake.requests[-1]["max_tokens"] == [256]
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Hi"}],
                                       max_completion_tokens=3)
        assert "max_tokens_fit" not in fake.requests[-1] and fake.requests[-1]["max_tokens"] == [3]
    finally:
        fake.step_s = step_s
        server.stop()


@pytest.mark.parametrize("body, param, words", [
    (b'{"prompt": "x", "temperature": NaN}', None, "request body: not valid JSON (NaN is not a JSON number"),
    (b'{"prompt": "x", "top_p": -Infinity}', None, "request body: not valid JSON (-Infinity is not a JSON number"),
    (b'{"prompt": "x", "temperature": 1e400}', "temperature", "temperature: inf is not a finite number"),
    (b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", "temperature", "is not a finite number"),
    (b'{"prompt": "x", "top_p": 1e39}', "top_p", "within the 32-bit float range"),
], ids=["nan", "-infinity", "1e400", "401-digits", "past-float32"])
def test_numbers_json_reads_but_a_tensor_cannot_hold_are_400s(endpoint, body, param, words):
    status, answer = call(f"{endpoint.url}/completions", body)
    assert status == 400 and error_of(answer)["param"] == param and words in answer["error"]["message"]


def test_an_upload_abandoned_mid_body_logs_no_traceback(endpoint):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("uvicorn.error").addHandler(handler)
    try:
        port = int(endpoint.url.rsplit(":", 1)[1].split("/")[0])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode()
                         + b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
            time.sleep(0.3)
        time.sleep(0.5)
        assert call(f"{endpoint.url}/models")[0] == 200
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING or r.exc_info] == []
