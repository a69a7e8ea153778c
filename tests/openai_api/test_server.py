"""pipeline/openai_api/server.py and app.py without a tritonserver: the endpoint starts on a reserved socket, answers
every failure with an OpenAI error body (503 while Triton is unreachable, 404/405 for routes, 400/413 for bodies),
and frees its port when stopped."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from pipeline.openai_api.protocol import ServedModel  # noqa: E402
from pipeline.openai_api.server import OpenAIServer, OpenAIServerError, reserve_port  # noqa: E402
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
    request = urllib.request.Request(url, data=body, method=method)
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
    status, answer = call(f"{endpoint.url}/completions", json.dumps({"prompt": "x", "n": 3}).encode())
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
