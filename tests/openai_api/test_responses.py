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
    body = reply.completions([reply.choice("def f", "length")], usage(5, 2), STATS)
    parsed = Completion.model_validate(body)
    assert parsed.object == "text_completion" and parsed.id.startswith("cmpl-") and parsed.model == "tiny"
    assert parsed.choices[0].text == "def f" and parsed.choices[0].finish_reason == "length"
    assert parsed.usage.total_tokens == 7 and parsed.model_extra["speculative"] == STATS


def test_a_chat_completion():
    reply = Reply.new(chat=True, model="tiny")
    body = reply.completions([reply.choice("Hi!", "stop")], usage(9, 3), STATS)
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


def test_logprobs_tool_calls_and_choices_validate_against_the_official_types():
    from pipeline.openai_api.logprobs import chat_logprobs, completion_logprobs
    from pipeline.openai_api.responses import merged_stats, tool_call_body
    from pipeline.tool_calls import ToolCall

    entries = [[5, "def", -0.1, [[5, "def", -0.1], [7, "class", -2.5]]], [9, " f", -0.3, []]]
    reply = Reply.new(chat=False, model="tiny")
    body = reply.completions([reply.choice("def f", "length", 0, completion_logprobs(entries)),
                              reply.choice("x", "stop", 1)], usage(3, 3), STATS)
    first, second = Completion.model_validate(body).choices
    assert (first.index, second.index, second.logprobs) == (0, 1, None)
    assert first.logprobs.tokens == ["def", " f"] and first.logprobs.text_offset == [0, 3]
    assert first.logprobs.top_logprobs == [{"def": -0.1, "class": -2.5}, {}]
    assert completion_logprobs(entries[1:], offset=3)["text_offset"] == [3]  # a later chunk counts on

    chat = Reply.new(chat=True, model="tiny")
    call = tool_call_body(ToolCall("call_0123", "get_weather", '{"city": "Paris"}'))
    body = chat.completions([chat.choice(None, "tool_calls", 0, chat_logprobs(entries), [call])], usage(3, 2), STATS)
    choice = ChatCompletion.model_validate(body).choices[0]
    assert choice.message.tool_calls[0].function.name == "get_weather" and choice.message.content is None
    assert choice.logprobs.content[1].bytes == list(b" f") and choice.logprobs.content[0].top_logprobs[1].logprob == -2.5
    delta = {"index": 0, "id": "call_0123", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    chunk = ChatCompletionChunk.model_validate(chat.chunk(tool_calls=[delta], index=2))
    assert chunk.choices[0].index == 2 and chunk.choices[0].delta.tool_calls[0].id == "call_0123"

    two = merged_stats([{"draft_tokens": 4, "accepted_tokens": 2, "target_steps": 2, "mean_accepted_len": 2.0},
                        {"draft_tokens": 4, "accepted_tokens": 4, "target_steps": 1, "mean_accepted_len": 5.0}])
    assert two == {"draft_tokens": 8, "accepted_tokens": 6, "target_steps": 3, "acceptance_rate": 0.75,
                   "mean_accepted_len": 3.0}
