"""The ASGI app (Starlette): ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``.

A request is checked (pipeline/openai_api/protocol.py), then run as one Triton request. Errors are OpenAI error
bodies with a status: 400 for a bad request (the model's own one-line validation errors included), 404 for an
unknown route or model, 503 when Triton cannot be reached or the server is shutting down, 504 past the request's
deadline (request_timeout_s). A streamed request waits for the engine's first step before it answers 200, so the
model refusing a request is a 400 there too; an error after that (Triton gone, the deadline, the server's drain
deadline) is sent in-band as an ``{"error": ...}`` event followed by ``data: [DONE]``, never a cut connection. A
client that disconnects, a deadline that passes and a drain that ends all cancel the Triton request.

The app sits behind the front's Guard (pipeline/front/guard.py): Host, Origin, API key and JSON bodies are checked
before a route runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..front.guard import Guard, GuardSettings
from ..front.http_server import drain_deadline
from ..tool_calls import ToolCallStream, parse_tool_calls
from .errors import ApiError, error_body
from .generation import Generation
from .protocol import GenerationRequest, ServedModel, parse_chat, parse_completion
from .logprobs import chat_logprobs, completion_logprobs
from .responses import DONE, Reply, merged_stats, model_card, sse, tool_call_body, usage
from .triton_stream import TritonStreamClient

ROUTES = "GET /v1/models, POST /v1/completions, POST /v1/chat/completions"
DEFAULT_REQUEST_TIMEOUT_S = 600.0


class _ClientGone(Exception):
    """The client disconnected before its answer was ready; nobody is left to answer."""


class EventStream(StreamingResponse):
    """Server-sent events whose generator is always closed, so its Triton request is cancelled even when the
    client disconnects while the generator waits at a ``yield``."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def create_app(served: ServedModel, triton_url: str, *, guard: GuardSettings,
               request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> Guard:
    """The app for one served model behind its guard; ``triton_url`` is tritonserver's gRPC address (host:port),
    ``request_timeout_s`` the longest one request may run (streamed or not) before it is ended and cancelled."""
    if not request_timeout_s > 0:
        raise ValueError(f"request_timeout_s: {request_timeout_s!r} must be > 0 (seconds)")
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        app.state.triton = TritonStreamClient(triton_url)  # its gRPC channel belongs to the server's event loop
        try:
            yield
        finally:
            await app.state.triton.close()

    async def list_models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card(served.name, created)]})

    async def get_model(request: Request) -> Response:
        if request.path_params["model"] != served.name:
            raise ApiError(404, f"model: {request.path_params['model']!r} is not served here; this endpoint serves "
                                f"{served.name!r}", param="model", code="model_not_found")
        return JSONResponse(model_card(served.name, created))

    async def completions(request: Request) -> Response:
        return await _generate(request, parse_completion(await _read_json(request, served.max_body_bytes), served))

    async def chat_completions(request: Request) -> Response:
        return await _generate(request, parse_chat(await _read_json(request, served.max_body_bytes), served))

    async def _generate(request: Request, parsed: GenerationRequest) -> Response:
        return await _answer(request, parsed, served.name, Ends(request_timeout_s, drain_deadline(request.scope)))

    routes = [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    handlers = {ApiError: _api_error, HTTPException: _http_error, _ClientGone: _client_gone,
                Exception: _internal_error}
    return Guard(Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan), guard, error_body)


async def _answer(request: Request, parsed: GenerationRequest, model: str, ends: Ends) -> Response:
    """One checked request's answer: a whole body, or an event stream once every choice's first step is in."""
    # n choices are n engine requests, batched with everything else; their shared prompt is computed once
    # when the prefix cache is on (the later ones find its blocks).
    generations = [Generation(request.app.state.triton, parsed, index) for index in range(parsed.n)]
    reply = Reply.new(parsed.chat, model)
    if not parsed.stream:
        try:
            texts = await ends.first(_all(map(_collect, generations)), request.receive)
        finally:
            await _close(generations)
        choices = [_choice(reply, parsed, generation, text) for generation, text in zip(generations, texts)]
        return JSONResponse(reply.completions(choices, _usage(generations),
                                              merged_stats([g.speculative for g in generations])))
    try:
        await ends.first(_all(g.start() for g in generations), request.receive)
    except BaseException:
        await _close(generations)
        raise
    return EventStream(_events(generations, reply, parsed, ends), media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class Ends:
    """What ends a request besides its own last step: its deadline (request_timeout_s from its start) and the
    front's drain deadline (``drained``)."""

    def __init__(self, timeout_s: float, drained: asyncio.Event):
        self.timeout_s = timeout_s
        self.deadline = asyncio.get_running_loop().time() + timeout_s
        self.drained = drained

    def error(self) -> ApiError:
        if self.drained.is_set():
            return ApiError(503, "server: shutting down, and this request did not finish in the time it was given; "
                                 "retry it", code="server_shutting_down")
        return ApiError(504, f"request: not finished within this server's {self.timeout_s:g} s limit "
                             f"(request_timeout_s); ask for fewer tokens (max_tokens), or split the work",
                        code="timeout")

    async def first(self, awaitable, receive=None):
        """The awaitable's result, unless the deadline passes or the drain deadline comes first (ApiError), or,
        given ``receive``, the client disconnects first (_ClientGone); the awaitable is then cancelled, which
        cancels its Triton request."""
        work = asyncio.ensure_future(awaitable)
        drained = asyncio.ensure_future(self.drained.wait())
        gone = asyncio.ensure_future(_disconnected(receive)) if receive is not None else None
        waiting = {work, drained} | ({gone} if gone is not None else set())
        try:
            left = self.deadline - asyncio.get_running_loop().time()
            await asyncio.wait(waiting, timeout=max(0.0, left), return_when=asyncio.FIRST_COMPLETED)
        finally:
            pending = {task for task in waiting if not task.done()}
            for task in pending:
                task.cancel()
            if pending:  # asyncio.wait, not await: a cancellation of this task itself must still propagate
                await asyncio.wait(pending)
        if not work.cancelled():
            return work.result()
        if gone is not None and gone.done() and not gone.cancelled():
            raise _ClientGone
        raise self.error()


async def _all(awaitables) -> list:
    """Every awaitable's result, in a task of its own (Ends.first cancels that task, which then reads as cancelled;
    a bare gather future ends with a CancelledError result instead). When one raises, the others are cancelled and
    waited for before the error goes on: gather alone leaves them running, and closing a choice's Triton stream
    while its task still reads it fails ("asynchronous generator is already running")."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(generation: Generation) -> str:
    return "".join([piece async for piece in generation.pieces()])


async def _close(generations: list[Generation]) -> None:
    for generation in generations:
        await generation.close()


def _usage(generations: list[Generation]) -> dict:
    """The prompt once, the completion tokens of every choice."""
    return usage(generations[0].prompt_tokens, sum(g.completion_tokens for g in generations))


def _logprobs(reply: Reply, entries: list, offset: int = 0) -> dict:
    return chat_logprobs(entries) if reply.chat else completion_logprobs(entries, offset)


def _choice(reply: Reply, parsed: GenerationRequest, generation: Generation, text: str) -> dict:
    """One choice of a whole answer: its text (a chat's tool calls parsed out of it) and its logprobs."""
    logprobs = _logprobs(reply, generation.logprobs) if parsed.logprobs else None
    if parsed.tool_format is None:
        return reply.choice(text, generation.finish_reason, generation.index, logprobs)
    content, calls = parse_tool_calls(text, parsed.tool_format)
    finish_reason = "tool_calls" if calls and generation.finish_reason == "stop" else generation.finish_reason
    return reply.choice(content, finish_reason, generation.index, logprobs, [tool_call_body(call) for call in calls])


async def _choice_chunks(generation: Generation, reply: Reply, parsed: GenerationRequest, ends: Ends):
    """One choice's stream: its role chunk (chat), its text pieces and tool-call deltas, and its last chunk with the
    finish reason and its acceptance statistics. Log-probabilities ride on the next content chunk after their tokens
    (text a tool parser holds back, or a call's own tokens, wait for it), and what is left on the last chunk."""
    chunk = functools.partial(reply.chunk, index=generation.index, include_usage=parsed.include_usage)
    tools = ToolCallStream(parsed.tool_format) if parsed.tool_format is not None else None
    pieces, pending, sent = generation.pieces(), [], 0

    def out(delta):
        nonlocal pending, sent
        if not isinstance(delta, str):
            return chunk(tool_calls=[delta])
        logprobs = _logprobs(reply, pending, sent) if pending else None
        pending, sent = [], sent + len(delta)
        return chunk(delta, logprobs=logprobs)

    try:
        if reply.chat:  # OpenAI's first chat chunk names the role
            yield chunk(role=True)
        while (piece := await ends.first(anext(pieces, None))) is not None:
            pending += generation.take_logprobs() if parsed.logprobs else []
            for delta in [piece] if tools is None else tools.feed(piece):
                yield out(delta)
        for delta in tools.finish() if tools is not None else []:
            yield out(delta)
        finish_reason = generation.finish_reason
        if tools is not None and tools.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        pending += generation.take_logprobs() if parsed.logprobs else []
        yield chunk(finish_reason=finish_reason, speculative=generation.speculative,
                    logprobs=_logprobs(reply, pending, sent) if pending else None)
    finally:
        await pieces.aclose()


async def _events(generations: list[Generation], reply: Reply, parsed: GenerationRequest, ends: Ends):
    streams = [_choice_chunks(generation, reply, parsed, ends) for generation in generations]
    try:
        async for body in _merged(streams):
            yield sse(body)
        if parsed.include_usage:
            yield sse(reply.usage_chunk(_usage(generations)))
    except ApiError as exc:  # the status line has gone out: the error travels in-band, as OpenAI's streams do
        yield sse(exc.body())
    finally:
        for stream in streams:
            await stream.aclose()
        await _close(generations)
    yield DONE


async def _merged(streams: list):
    """The items of several async iterators as each arrives (one iterator: in order, without tasks); the first
    error of any ends the whole."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(stream):
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(end)
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, who raises it
            await queue.put(exc)

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is end:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _read_json(request: Request, limit: int) -> object:
    """The body as JSON, refused past ``limit`` bytes before it is all read (the prompt's own limit is far below)."""
    too_large = ApiError(413, f"request body: over the {limit}-byte limit for this model's max_input_len; shorten "
                              f"the prompt")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:  # an upload abandoned mid-body: nobody is left to answer
        raise _ClientGone from None
    try:
        return json.loads(b"".join(chunks), parse_constant=_not_json)
    except (ValueError, RecursionError) as exc:  # RecursionError: thousands of nested brackets
        raise ApiError(400, f"request body: not valid JSON ({str(exc)[:120]})") from None


def _not_json(literal: str):
    # Python's json reads NaN and Infinity; JSON has no such numbers, and no tensor should receive one.
    raise ValueError(f"{literal} is not a JSON number; send a number")


async def _disconnected(receive) -> None:
    # The body has been read: the next message the server hands over is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


async def _api_error(request: Request, exc: ApiError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path}); this server has {ROUTES}"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}; this server has {ROUTES}"
    else:
        message = str(exc.detail)
    return JSONResponse(ApiError(exc.status_code, message).body(), status_code=exc.status_code, headers=exc.headers)


async def _client_gone(request: Request, exc: _ClientGone) -> Response:
    return Response(status_code=499)  # never delivered: the connection is closed


async def _internal_error(request: Request, exc: Exception) -> Response:
    message = f"internal error: {type(exc).__name__}: {exc}"
    return JSONResponse(ApiError(500, message).body(), status_code=500)
