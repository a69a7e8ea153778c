"""pipeline/openai_api/responses.py: every body parses as the official client's own types (OpenAI's schema), with the
acceptance statistics as the one extra field, on the final response or chunk only."""

from __future__ import annotations

import json

import pytest

openai_types = pytest.importorskip("openai.types")
from openai.types import Completion, Model  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

from pipeline.openai_api.responses import DONE, Reply, model_card, sse, usage  # noqa: E402

STATS = {"draft_tokens": 8, "accepted_tokens": 6, "target_steps": 3, "acceptance_rate": 0.75, "mean_accepted_len": 3.0}


def test_a_completion():
    reply = Reply.new(chat=False, model="tiny")
    body = reply.completion("def f", "length", usage(5, 2), STATS)
    parsed = Completion.model_validate(body)
    assert parsed.object == "text_completion" and parsed.id.startswith("cmpl-") and parsed.model == "tiny"
    assert parsed.choices[0].text == "def f" and parsed.choices[0].finish_reason == "length"
    assert parsed.usage.total_tokens == 7 and parsed.model_extra["speculative"] == STATS


def test_a_chat_completion():
    body = Reply.new(chat=True, model="tiny").completion("Hi!", "stop", usage(9, 3), STATS)
    parsed = ChatCompletion.model_validate(body)
    assert parsed.object == "chat.completion" and parsed.id.startswith("chatcmpl-")
    assert parsed.choices[0].message.role == "assistant" and parsed.choices[0].message.content == "Hi!"
    assert parsed.usage.prompt_tokens == 9 and parsed.model_extra["speculative"] == STATS


def test_chat_chunks_role_first_statistics_last_then_usage():
    reply = Reply.new(chat=True, model="tiny")
    first, middle = reply.chunk(role=True, include_usage=True), reply.chunk("Hel", include_usage=True)
    last = reply.chunk(finish_reason="stop", include_usage=True, speculative=STATS)
    chunks = [ChatCompletionChunk.model_validate(b) for b in (first, middle, last, reply.usage_chunk(usage(4, 1)))]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert chunks[1].choices[0].delta.content == "Hel" and chunks[1].choices[0].delta.role is None
    assert chunks[2].choices[0].finish_reason == "stop" and last["choices"][0]["delta"] == {}
    assert "speculative" not in middle and chunks[2].model_extra["speculative"] == STATS
    assert all(b["usage"] is None for b in (first, middle, last))  # OpenAI: null until the usage chunk
    assert chunks[3].choices == [] and chunks[3].usage.completion_tokens == 1
    assert {c.id for c in chunks} == {reply.id} and {c.object for c in chunks} == {"chat.completion.chunk"}


def test_completion_chunks_without_usage():
    reply = Reply.new(chat=False, model="tiny")
    body = reply.chunk("x = ")
    # OpenAI streams legacy completions as Completion objects with finish_reason null until the last (its type
    # says otherwise; the client does not validate chunks)
    assert "usage" not in body and body["choices"] == [{"index": 0, "logprobs": None, "finish_reason": None,
                                                        "text": "x = "}]
    assert body["object"] == "text_completion" and body["id"] == reply.id
    assert Completion.model_validate(reply.chunk(finish_reason="length", speculative=STATS)).choices[0].text == ""


def test_server_sent_events():
    event = sse({"a": "ü\n"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    assert json.loads(event[len(b"data: "):]) == {"a": "ü\n"}
    assert DONE == b"data: [DONE]\n\n"


def test_model_card():
    assert Model.model_validate(model_card("tiny", 1700000000)).id == "tiny"
