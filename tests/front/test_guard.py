"""pipeline/front/guard.py: Host, Origin (CORS), API key and body-type checks, driven through ASGI directly, and
tritonclient.http's own requests passing the ``not-simple`` body check of a live front."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

pytest.importorskip("uvicorn")

from pipeline.front.guard import Guard, GuardSettings, allowed_hosts_for  # noqa: E402

KEY = "s3cret-key-Zq9"
LOCAL = allowed_hosts_for("127.0.0.1", 8080)


def error_body(status: int, message: str) -> dict:
    return {"error": {"status": status, "message": message}}


def call(settings: GuardSettings, method: str = "GET", path: str = "/v1/models", **headers: str) -> tuple:
    """(status, headers, body) of one request through the guard; the app behind it answers 200 {"ok": true}."""
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"ok":true}'})

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    raw = [(name.replace("_", "-").lower().encode(), value.encode("latin-1")) for name, value in headers.items()]
    scope = {"type": "http", "method": method, "path": path, "headers": raw}
    asyncio.run(Guard(app, settings, error_body)(scope, receive, send))
    start = sent[0]
    answer = {name.decode(): value.decode() for name, value in start["headers"]}
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]) or b"null")
    assert bool(reached) == (start["status"] == 200)  # a refusal never reaches the app
    return start["status"], answer, body


def refusal(settings: GuardSettings, status: int, **request) -> str:
    code, headers, body = call(settings, **request)
    assert code == status and body["error"]["status"] == status, (code, body)
    message = body["error"]["message"]
    assert "\n" not in message and headers["content-type"] == "application/json"
    return message


@pytest.mark.parametrize("bind, expected", [
    ("127.0.0.1", ("localhost:8080", "127.0.0.1:8080", "[::1]:8080")),
    ("0.0.0.0", ("localhost:8080", "127.0.0.1:8080", "[::1]:8080", "0.0.0.0:8080")),
    ("::", ("localhost:8080", "127.0.0.1:8080", "[::1]:8080", "[::]:8080")),
    ("::1", ("localhost:8080", "127.0.0.1:8080", "[::1]:8080")),
    ("10.1.2.3", ("10.1.2.3:8080",)),
    ("gpu-box.lan", ("gpu-box.lan:8080",)),
], ids=["loopback", "wildcard", "wildcard6", "loopback6", "address", "name"])
def test_allowed_hosts_for_a_bind_address(bind, expected):
    assert allowed_hosts_for(bind, 8080) == expected
    assert allowed_hosts_for(bind, 8080, ["api.example"])[-1] == "api.example"


@pytest.mark.parametrize("host", ["localhost:8080", "LOCALHOST:8080", "127.0.0.1:8080", "[::1]:8080",
                                  "[0:0::1]:8080", "localhost.:8080"])
def test_the_loopback_names_pass(host):
    assert call(GuardSettings(LOCAL), host=host)[0] == 200


@pytest.mark.parametrize("host", ["evil.example:8080", "evil.example", "localhost:9999", "localhost",
                                  "127.0.0.1:8080:1", "[::1", "local host:8080", ""])
def test_a_host_not_allowed_is_refused_naming_the_setting(host):
    # DNS rebinding: a page on evil.example, its name now resolving to 127.0.0.1, sends Host: evil.example
    message = refusal(GuardSettings(LOCAL), 421, host=host)
    assert message.startswith("Host header: ") and "serve.allowed_hosts" in message


def test_host_rules():
    settings = GuardSettings(("api.example", "box:80"))
    assert call(settings, host="API.example:1234")[0] == 200  # a name without a port: any port
    assert call(settings, host="box")[0] == 200  # no port in Host means 80
    assert call(settings, host="box:8080")[0] == 421
    assert "Host header: missing" in refusal(settings, 421)
    assert "sent more than once" in refusal(settings, 400, host="api.example", HOST="api.example")


def test_an_origin_not_allowed_is_refused_and_no_cors_header_is_sent_by_default():
    settings = GuardSettings(LOCAL)
    message = refusal(settings, 403, host="localhost:8080", origin="https://evil.example")
    assert message.startswith("Origin header: 'https://evil.example'") and "serve.allowed_origins" in message
    status, headers, _ = call(settings, host="localhost:8080")
    assert status == 200 and not any(name.startswith("access-control") for name in headers)
    # a preflight from anywhere is refused too
    assert refusal(settings, 403, method="OPTIONS", host="localhost:8080", origin="https://evil.example",
                   access_control_request_method="POST").startswith("Origin header:")


def test_an_allowed_origin_gets_cors_answers():
    settings = GuardSettings(LOCAL, allowed_origins=("https://app.example",), api_key=KEY)
    status, headers, _ = call(settings, method="OPTIONS", host="localhost:8080", origin="https://app.example",
                              access_control_request_method="POST",
                              access_control_request_headers="authorization, content-type")
    assert status == 204  # a preflight carries no key: browsers never send credentials with it
    assert headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in headers["access-control-allow-methods"]
    assert {"authorization", "content-type"} <= {h.strip().lower() for h in
                                                 headers["access-control-allow-headers"].split(",")}
    status, headers, _ = call(settings, host="localhost:8080", origin="https://app.example",
                              authorization=f"Bearer {KEY}")
    assert status == 200 and headers["access-control-allow-origin"] == "https://app.example"
    # a refusal is readable by the page too, so it can show why
    status, headers, _ = call(settings, host="localhost:8080", origin="https://app.example")
    assert status == 401 and headers["access-control-allow-origin"] == "https://app.example"
    assert refusal(settings, 403, host="localhost:8080", origin="https://app.example.evil.example")


def test_the_api_key():
    settings = GuardSettings(LOCAL, api_key=KEY, open_paths=("/v2/health",))
    missing = refusal(settings, 401, host="localhost:8080")
    wrong = refusal(settings, 401, host="localhost:8080", authorization="Bearer not-the-key")
    basic = refusal(settings, 401, host="localhost:8080", authorization=f"Basic {KEY}")
    assert missing.startswith("Authorization header: missing") and "Bearer" in missing
    assert wrong.startswith("Authorization header: the bearer token is not")
    assert basic.startswith("Authorization header: the 'Basic' scheme")
    assert not any(KEY in text for text in (missing, wrong, basic, repr(settings)))
    assert call(settings, host="localhost:8080")[1]["www-authenticate"] == "Bearer"
    assert call(settings, host="localhost:8080", authorization=f"Bearer {KEY}")[0] == 200
    assert call(settings, host="localhost:8080", authorization=f"bearer  {KEY}")[0] == 200
    # open paths: whole segments, no way out of them with dot segments
    assert call(settings, path="/v2/health/ready", host="localhost:8080")[0] == 200
    assert call(settings, path="/v2/health", host="localhost:8080")[0] == 200
    assert call(settings, path="/v2/healthy", host="localhost:8080")[0] == 401
    assert call(settings, path="/v2/health/../models/m/infer", host="localhost:8080")[0] == 401
    # without a key, whatever Authorization a client sends (the openai client always sends one) is ignored
    assert call(GuardSettings(LOCAL), host="localhost:8080", authorization="Bearer unused")[0] == 200


@pytest.mark.parametrize("content_type, status", [
    ("application/json", 200), ("application/json; charset=utf-8", 200), ("Application/JSON", 200),
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415), ("multipart/form-data; boundary=x", 415),
    ("application/octet-stream", 415), (None, 415),
])
def test_json_bodies(content_type, status):
    headers = {"host": "localhost:8080"} | ({"content_type": content_type} if content_type else {})
    code, _, body = call(GuardSettings(LOCAL), method="POST", path="/v1/completions", **headers)
    assert code == status
    if status == 415:
        assert body["error"]["message"].startswith("Content-Type header: ") and "application/json" in \
            body["error"]["message"]
    assert call(GuardSettings(LOCAL), method="GET", **headers)[0] == 200  # a GET's content type is not checked


@pytest.mark.parametrize("content_type, status", [
    ("text/plain;charset=UTF-8", 415), ("application/x-www-form-urlencoded", 415), ("multipart/form-data", 415),
    ("application/octet-stream", 200), ("application/json", 200), (None, 200),
])
def test_not_simple_bodies(content_type, status):
    headers = {"host": "localhost:8080"} | ({"content_type": content_type} if content_type else {})
    settings = GuardSettings(LOCAL, body="not-simple")
    assert call(settings, method="POST", path="/v2/models/m/infer", **headers)[0] == status


@pytest.mark.parametrize("field, value, words", [
    ("allowed_hosts", (), "allowed_hosts: empty"),
    ("allowed_hosts", ("a b",), "allowed_hosts: 'a b' is not a host"),
    ("allowed_origins", ("app.example",), "allowed_origins: 'app.example' is not an origin"),
    ("api_key", "", "api_key: empty"),
    ("api_key", "two words", "api_key: empty, not ASCII, or holds whitespace"),
    ("body", "xml", "body: 'xml'"),
    ("open_paths", ("health",), "open_paths: 'health' must start with /"),
])
def test_settings_are_checked(field, value, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        GuardSettings(**{"allowed_hosts": LOCAL, field: value})


def test_tritonclient_http_requests_pass_the_not_simple_check():
    """Both tritonclient.http clients (gevent: no Content-Type; aio: application/octet-stream), binary tensors and
    JSON ones, through a live front with the not-simple guard and an API key."""
    tritonclient_http = pytest.importorskip("tritonclient.http")
    import tritonclient.http.aio as aio
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from pipeline.front.http_server import HttpFront, reserve_port

    seen = []

    async def infer(request):
        seen.append(request.headers.get("content-type"))
        await request.body()
        return JSONResponse({"model_name": "m", "outputs": []})

    app = Starlette(routes=[Route("/v2/models/m/infer", infer, methods=["POST"])])
    sock = reserve_port("127.0.0.1", 0, "test.port", "pick another")
    port = sock.getsockname()[1]
    settings = GuardSettings(allowed_hosts_for("127.0.0.1", port), api_key=KEY, body="not-simple")
    front = HttpFront(Guard(app, settings, error_body), sock, name="test-front").start()
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        client = tritonclient_http.InferenceServerClient(f"127.0.0.1:{port}")
        for binary in (True, False):
            tensor = tritonclient_http.InferInput("x", [1, 2], "FP32")
            tensor.set_data_from_numpy(np.ones((1, 2), np.float32), binary_data=binary)
            client.infer("m", [tensor], headers=auth)
        client.close()

        async def with_aio():
            aio_client = aio.InferenceServerClient(f"127.0.0.1:{port}")
            try:
                for binary in (True, False):
                    tensor = aio.InferInput("x", [1, 2], "FP32")
                    tensor.set_data_from_numpy(np.ones((1, 2), np.float32), binary_data=binary)
                    await aio_client.infer("m", [tensor], headers=auth)
            finally:
                await aio_client.close()

        asyncio.run(with_aio())
    finally:
        front.stop()
    assert len(seen) == 4 and set(seen) <= {None, "application/octet-stream"}, seen
