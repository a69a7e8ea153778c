"""The ASGI app (Starlette): ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``.

A request is checked (pipeline/openai_api/protocol.py), then run as one Triton request. Errors are OpenAI error
bodies with a status: 400 for a bad request (the model's own one-line validation errors included), 404 for an
unknown route or model, 503 when Triton cannot be reached. A streamed request waits for the engine's first step
before it answers 200, so the model refusing a request is a 400 there too; an error after that is sent in-band as
an ``{"error": ...}`` event. A client that disconnects cancels its Triton request, streamed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .errors import ApiError
from .generation import Generation
from .protocol import GenerationRequest, ServedModel, parse_chat, parse_completion
from .responses import DONE, Reply, model_card, sse, usage
from .triton_stream import TritonStreamClient

ROUTES = "GET /v1/models, POST /v1/completions, POST /v1/chat/completions"


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


def create_app(served: ServedModel, triton_url: str) -> Starlette:
    """The app for one served model; ``triton_url`` is tritonserver's gRPC address (host:port)."""
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
        generation = Generation(request.app.state.triton, parsed)
        reply = Reply.new(parsed.chat, served.name)
        if not parsed.stream:
            try:
                text = await _unless_disconnected(request, _collect(generation))
            finally:
                await generation.close()
            totals = usage(generation.prompt_tokens, generation.completion_tokens)
            return JSONResponse(reply.completion(text, generation.finish_reason, totals, generation.speculative))
        try:
            await _unless_disconnected(request, generation.start())
        except BaseException:
            await generation.close()
            raise
        return EventStream(_events(generation, reply, parsed.include_usage), media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    routes = [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    handlers = {ApiError: _api_error, HTTPException: _http_error, _ClientGone: _client_gone,
                Exception: _internal_error}
    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)


async def _collect(generation: Generation) -> str:
    return "".join([piece async for piece in generation.pieces()])


async def _events(generation: Generation, reply: Reply, include_usage: bool):
    try:
        if reply.chat:  # OpenAI's first chat chunk names the role
            yield sse(reply.chunk(role=True, include_usage=include_usage))
        async for piece in generation.pieces():
            yield sse(reply.chunk(piece, include_usage=include_usage))
        yield sse(reply.chunk(finish_reason=generation.finish_reason, include_usage=include_usage,
                              speculative=generation.speculative))
        if include_usage:
            yield sse(reply.usage_chunk(usage(generation.prompt_tokens, generation.completion_tokens)))
    except ApiError as exc:  # the status line has gone out: the error travels in-band, as OpenAI's streams do
        yield sse(exc.body())
    finally:
        await generation.close()
    yield DONE


async def _read_json(request: Request, limit: int) -> object:
    """The body as JSON, refused past ``limit`` bytes before it is all read (the prompt's own limit is far below)."""
    too_large = ApiError(413, f"request body: over the {limit}-byte limit for this model's max_input_len; shorten "
                              f"the prompt")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:  # RecursionError: thousands of nested brackets
        raise ApiError(400, f"request body: not valid JSON ({str(exc)[:120]})") from None


async def _unless_disconnected(request: Request, awaitable):
    """The awaitable's result; it is cancelled, and _ClientGone raised, when the client disconnects first."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (gone, work):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    if work.cancelled():
        raise _ClientGone
    return work.result()


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
