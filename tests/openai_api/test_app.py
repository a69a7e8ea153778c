"""pipeline/openai_api/app.py's streaming response, driven through ASGI directly: a client that disconnects while
the event generator waits at a ``yield`` still gets its generator closed (which cancels the Triton request), without
waiting for garbage collection."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("starlette")

from pipeline.openai_api.app import EventStream  # noqa: E402


def test_a_disconnect_closes_the_event_generator():
    closed = []

    async def events():
        try:
            yield b"data: 1\n\n"
            yield b"data: 2\n\n"
        finally:
            closed.append(True)

    generator = events()  # held here: garbage collection would close it too, and must not be what does

    async def receive():
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()  # a client that stopped reading

    async def respond() -> list:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST", "headers": []}
        await asyncio.wait_for(EventStream(generator, media_type="text/event-stream")(scope, receive, send), 10)
        return list(closed)  # before asyncio.run's own clean-up closes every generator left open

    assert asyncio.run(respond()) == [True]


def test_an_error_after_the_first_event_goes_in_band_then_done():
    from pipeline.openai_api.app import Ends, _events
    from pipeline.openai_api.errors import ApiError
    from pipeline.openai_api.generation import Generation
    from pipeline.openai_api.protocol import GenerationRequest
    from pipeline.openai_api.responses import DONE, Reply
    from pipeline.openai_api.triton_stream import Step

    class FailingTriton:
        async def steps(self, inputs):
            yield Step("def", [1], "", 3, {})
            raise ApiError(500, "internal error: RuntimeError: the step failed")

    async def events() -> list[bytes]:
        parsed = GenerationRequest(chat=True, inputs={}, include_usage=True)
        generation = Generation(FailingTriton(), parsed)
        await generation.start()
        reply = Reply.new(chat=True, model="m")
        return [event async for event in _events([generation], reply, parsed, ends=Ends(60, asyncio.Event()))]

    sent = asyncio.run(events())
    assert b'"role":"assistant"' in sent[0] and b'"content":"def"' in sent[1]
    assert sent[2].startswith(b'data: {"error":') and b"the step failed" in sent[2] and sent[3:] == [DONE]


def test_an_upload_abandoned_mid_body_is_not_an_error():
    """Starlette raises ClientDisconnect from request.stream(); the app ends the request quietly instead of letting
    it reach the 500 handler (which re-raises it to the server, where it prints a traceback)."""
    from pipeline.front.guard import GuardSettings
    from pipeline.openai_api.app import create_app
    from pipeline.openai_api.protocol import ServedModel

    app = create_app(ServedModel("m", 512, 256, 8192), "127.0.0.1:1", guard=GuardSettings(("localhost",)))
    messages = iter([{"type": "http.request", "body": b'{"prompt": ', "more_body": True},
                     {"type": "http.disconnect"}])

    async def receive():
        return next(messages)

    async def send(message):
        pass

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 5000),
             "headers": [(b"host", b"localhost"), (b"content-type", b"application/json"),
                         (b"content-length", b"1000")]}
    asyncio.run(app(scope, receive, send))  # raised ClientDisconnect before


def test_streamed_logprobs_with_tools_are_each_sent_once():
    """Text a tool parser holds back (a possible call marker) and a call's own tokens carry logprobs too: they ride on
    the next content chunk or the last one, never dropped, never repeated."""
    from pipeline.openai_api.app import Ends, _events
    from pipeline.openai_api.generation import Generation
    from pipeline.openai_api.protocol import GenerationRequest
    from pipeline.openai_api.responses import Reply
    from pipeline.openai_api.triton_stream import Step

    texts = ["Hi <tool", '_call>{"name": "f", "arguments": {}}</tool_call>', " bye"]

    class ScriptedTriton:
        async def steps(self, inputs):
            for i, text in enumerate(texts):
                entries = [[i, text, -0.5 * (i + 1), []]]
                yield Step(text, [i], "eos" if i == len(texts) - 1 else "", 3, {}, logprobs=entries)

    async def events() -> list[dict]:
        parsed = GenerationRequest(chat=True, inputs={}, logprobs=True, tool_format="hermes")
        generation = Generation(ScriptedTriton(), parsed)
        await generation.start()
        sent = [event async for event in _events([generation], Reply.new(chat=True, model="m"), parsed,
                                                 ends=Ends(60, asyncio.Event()))]
        return [json.loads(event[6:]) for event in sent if event.startswith(b"data: {")]

    bodies = asyncio.run(events())
    entries = [entry["logprob"] for body in bodies for choice in body["choices"] if choice["logprobs"]
               for entry in choice["logprobs"]["content"]]
    assert sorted(entries) == [-1.5, -1.0, -0.5]  # each token's once
    calls = [d for b in bodies for c in b["choices"] for d in c.get("delta", {}).get("tool_calls", [])]
    assert calls and calls[0]["function"]["name"] == "f" and bodies[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_choice_refused_at_its_start_ends_the_others_cleanly():
    """n choices start together; one the model refuses raises its 400 while the others still wait for their first
    step: those are cancelled before their streams are closed (closing a stream a task still reads fails)."""
    from pipeline.openai_api.app import _all, _close
    from pipeline.openai_api.errors import ApiError
    from pipeline.openai_api.generation import Generation
    from pipeline.openai_api.protocol import GenerationRequest

    class OneRefused:
        async def steps(self, inputs):
            if inputs["seed"] == 1:
                raise ApiError(400, "response_format: too large", param="response_format")
            await asyncio.Event().wait()  # never answers
            yield None

    async def start() -> int:
        parsed = GenerationRequest(chat=True, inputs={"seed": 0}, n=3)
        generations = [Generation(OneRefused(), parsed, index) for index in range(3)]
        try:
            await _all(g.start() for g in generations)
        except ApiError as exc:
            await _close(generations)
            return exc.status
        return 200

    assert asyncio.run(asyncio.wait_for(start(), 10)) == 400
