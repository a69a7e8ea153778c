"""ASGI middleware that refuses what a hostile web page or client sends, before the app sees the request.

A server bound to loopback is still reachable from every web page its user opens: a page may send requests to
127.0.0.1 cross-site, or, after DNS rebinding (evil.example resolved to 127.0.0.1), as if it were the server's own
origin. The checks, in order, each refusal a one-line JSON body made by the app's own ``error_body``:

- Host: rebinding keeps the attacker's name in the Host header, so only the names in ``allowed_hosts`` pass (421).
- Origin: browsers send it on every cross-site request and on every POST; only ``allowed_origins`` pass (403). An
  allowed origin's preflight (OPTIONS) is answered here, and its responses carry ``Access-Control-Allow-Origin``;
  with no allowed origins no CORS header is ever sent, so a page cannot read an answer either.
- API key: when set, every request but the ``open_paths`` needs ``Authorization: Bearer <key>`` (401 with
  ``WWW-Authenticate: Bearer``). The key is compared in constant time and never written into a message or a log.
- Body type: a page can send text/plain, form and multipart bodies cross-site without a preflight, so ``json``
  accepts only application/json and ``not-simple`` refuses exactly those three types (415).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..errors import short_repr

# The CORS "simple" content types: what a web page can POST cross-site without the browser asking first.
SIMPLE_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
CORS_METHODS = "GET, POST"
CORS_HEADERS = "Authorization, Content-Type"
CORS_MAX_AGE_S = 600  # how long a browser may reuse a preflight's answer
HTTP_DEFAULT_PORT = 80  # a Host header without a port means this one

ErrorBody = Callable[[int, str], dict]


@dataclass(frozen=True)
class GuardSettings:
    """What a front accepts; see the module docstring for what each check stops."""

    # Host header values accepted: "name" (any port) or "name:port", case-insensitive; IPv6 as "[::1]" or "[::1]:80"
    allowed_hosts: tuple[str, ...]
    allowed_origins: tuple[str, ...] = ()  # browser origins ("https://app.example:8443") allowed cross-site
    api_key: str | None = field(default=None, repr=False)  # repr=False: the key stays out of every repr and log
    body: Literal["json", "not-simple"] = "json"
    open_paths: tuple[str, ...] = ()  # path prefixes (whole segments) served without the API key: health checks

    def __post_init__(self):
        if not self.allowed_hosts:
            raise ValueError("allowed_hosts: empty, so every request would be refused; use allowed_hosts_for()")
        for entry in self.allowed_hosts:
            if _split_host(entry.lower()) is None:
                raise ValueError(f"allowed_hosts: {short_repr(entry, 60)} is not a host name, address or name:port; "
                                 f"write IPv6 addresses in brackets ([::1])")
        for origin in self.allowed_origins:
            scheme, sep, rest = origin.partition("://")
            if origin != "null" and (not sep or scheme.lower() not in ("http", "https") or not rest
                                     or "/" in rest.rstrip("/")):
                raise ValueError(f"allowed_origins: {short_repr(origin, 60)} is not an origin; write "
                                 f"scheme://host[:port], such as https://app.example")
        if self.api_key is not None and (not self.api_key or not self.api_key.isascii()
                                         or any(c.isspace() for c in self.api_key)):
            raise ValueError("api_key: empty, not ASCII, or holds whitespace; use a printable ASCII token such as "
                             "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
        if self.body not in ("json", "not-simple"):
            raise ValueError(f"body: {short_repr(self.body, 40)} is not 'json' or 'not-simple'")
        for path in self.open_paths:
            if not path.startswith("/"):
                raise ValueError(f"open_paths: {short_repr(path, 60)} must start with /")


def allowed_hosts_for(bind_address: str, port: int, extra: Sequence[str] = ()) -> tuple[str, ...]:
    """The Host values a server bound to (bind_address, port) answers to: the loopback names when it is bound to
    loopback or to every address (a local client reaches a wildcard through loopback), the bind address itself,
    then ``extra`` (the names remote clients use)."""
    host = bind_address.strip("[]")
    try:
        address = ipaddress.ip_address(host)
        local = address.is_loopback or address.is_unspecified
        own = f"[{address.compressed}]" if address.version == 6 else address.compressed
    except ValueError:
        local = host.lower() in ("", "localhost")
        own = host.lower()
    names = [*(LOOPBACK_NAMES if local else ()), *([own] if own else [])]
    hosts = [f"{name}:{port}" for name in dict.fromkeys(names)]
    return tuple(dict.fromkeys([*hosts, *extra]))


class Guard:
    """ASGI middleware: ``Guard(app, settings, error_body)``; ``error_body(status, message)`` is the app's own error
    body (a dict), so a refusal looks like every other error of that API."""

    def __init__(self, app, settings: GuardSettings, error_body: ErrorBody):
        self.app = app
        self.settings = settings
        self.error_body = error_body
        self._hosts = [_split_host(entry.lower()) for entry in settings.allowed_hosts]
        self._origins = frozenset(origin.lower().rstrip("/") for origin in settings.allowed_origins)
        self._key = None if settings.api_key is None else settings.api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan passes; websockets are not served (uvicorn runs with ws="none")
            await self.app(scope, receive, send)
            return
        headers, repeated = _headers(scope)
        origin = headers.get("origin")
        allowed_origin = origin if origin is not None and origin.lower() in self._origins else None
        send = _with_cors(send, allowed_origin) if allowed_origin and not repeated else send
        refusal = self._host_refusal(headers)
        if repeated:  # two values of a header the checks read: which one a later hop reads is anyone's guess
            refusal = 400, f"{repeated.title()} header: sent more than once; send it once"
        if refusal is None and origin is not None and allowed_origin is None:
            refusal = 403, (f"Origin header: {short_repr(origin, 80)} may not call this server from a browser; add "
                            f"it to serve.allowed_origins if that page should")
        if refusal is None and allowed_origin and scope["method"] == "OPTIONS" \
                and "access-control-request-method" in headers:
            await _preflight(send)
            return
        if refusal is None and self._key is not None and not self._is_open(scope["path"]):
            refusal = self._key_refusal(headers.get("authorization"))
        if refusal is None and scope["method"] in BODY_METHODS:
            refusal = self._body_refusal(headers.get("content-type"))
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, message = refusal
        extra = [(b"www-authenticate", b"Bearer")] if status == 401 else []
        await respond(send, status, self.error_body(status, message), extra)

    def _host_refusal(self, headers: dict) -> tuple[int, str] | None:
        value = headers.get("host")
        if value is None:
            return 421, "Host header: missing; send the name this server answers to (serve.allowed_hosts)"
        parsed = _split_host(value.lower())
        if parsed is not None:
            name, port = parsed
            port = HTTP_DEFAULT_PORT if port is None else port
            if any(name == n and (p is None or p == port) for n, p in self._hosts):
                return None
        return 421, (f"Host header: {short_repr(value, 80)} is not a name this server answers to (the check stops "
                     f"DNS rebinding); add it to serve.allowed_hosts if clients reach the server by that name")

    def _is_open(self, path: str) -> bool:
        # Whole segments only, and no dot segments: "/v2/health/../models/x/infer" is not a health check.
        if any(part in (".", "..") for part in path.split("/")):
            return False
        return any(path == p.rstrip("/") or path.startswith(p.rstrip("/") + "/") for p in self.settings.open_paths)

    def _key_refusal(self, authorization: str | None) -> tuple[int, str] | None:
        fix = "send 'Authorization: Bearer <API key>' with the key this server was started with"
        if authorization is None:
            return 401, f"Authorization header: missing; {fix}"
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return 401, f"Authorization header: the {short_repr(scheme, 20)} scheme is not accepted; {fix}"
        # The comparison takes the same time wherever the first difference is; only the length can show.
        if not hmac.compare_digest(token.strip().encode("latin-1"), self._key):
            return 401, f"Authorization header: the bearer token is not this server's API key; {fix}"
        return None

    def _body_refusal(self, content_type: str | None) -> tuple[int, str] | None:
        media = None if content_type is None else content_type.split(";", 1)[0].strip().lower()
        if self.settings.body == "json":
            if media == "application/json":
                return None
            given = "missing" if content_type is None else f"{short_repr(content_type, 60)} is not application/json"
            return 415, f"Content-Type header: {given}; send the JSON body with 'Content-Type: application/json'"
        if media in SIMPLE_TYPES:
            return 415, (f"Content-Type header: {short_repr(content_type, 60)} is a type web pages may send "
                         f"cross-site; send binary tensor data as application/octet-stream and JSON as "
                         f"application/json")
        return None


READ_HEADERS = ("host", "origin", "authorization", "content-type", "access-control-request-method")


def _headers(scope) -> tuple[dict[str, str], str | None]:
    """The request headers the guard reads, by lower-case name, and the name of one that came more than once."""
    found: dict[str, str] = {}
    repeated = None
    for raw_name, raw_value in scope["headers"]:
        name = raw_name.decode("latin-1").lower()
        if name in READ_HEADERS:
            repeated = repeated or (name if name in found else None)
            found[name] = raw_value.decode("latin-1").strip()
    return found, repeated


def _split_host(value: str) -> tuple[str, int | None] | None:
    """(name, port or None) of a lower-case Host value or allowed_hosts entry; None when it is not one."""
    if value.startswith("["):
        end = value.find("]")
        try:
            name = f"[{ipaddress.IPv6Address(value[1:end]).compressed}]" if end > 0 else ""
        except ValueError:
            return None
        rest = value[end + 1:]
    else:
        name, sep, port = value.partition(":")
        rest = sep + port
        name = name[:-1] if name.endswith(".") else name  # "localhost." is localhost
        if not name.isascii() or any(not (c.isalnum() or c in "-._") for c in name):
            return None
    if not name:
        return None
    if not rest:
        return name, None
    if not rest.startswith(":") or not rest[1:].isdigit() or not 0 < int(rest[1:]) < 65536:
        return None
    return name, int(rest[1:])


def _with_cors(send, origin: str):
    """``send`` that marks every response to an allowed origin as readable by that origin's pages."""

    async def cors_send(message) -> None:
        if message["type"] == "http.response.start":
            headers = [*message.get("headers", []), (b"access-control-allow-origin", origin.encode("latin-1")),
                       (b"vary", b"Origin")]
            message = {**message, "headers": headers}
        await send(message)

    return cors_send


async def _preflight(send) -> None:
    headers = [(b"access-control-allow-methods", CORS_METHODS.encode()),
               (b"access-control-allow-headers", CORS_HEADERS.encode()),
               (b"access-control-max-age", str(CORS_MAX_AGE_S).encode()), (b"content-length", b"0")]
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


async def respond(send, status: int, body: dict, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """A one-line JSON answer that closes the connection (an unread request body is not read on)."""
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": data})
