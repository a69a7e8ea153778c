"""pipeline/openai_api/protocol.py: OpenAI request bodies -> Triton inputs, and every refusal a 400 (404 for another
model) whose message starts with the field it names, without a server."""

from __future__ import annotations

import dataclasses

import json

import pytest

from pipeline.openai_api.errors import ApiError
from pipeline.openai_api.protocol import (CHAT_MAX_TOKENS_CAP, COMPLETION_MAX_TOKENS, ServedModel, parse_chat,
                                          parse_completion)

SERVED = ServedModel("tiny-chat", max_seq_len=512, max_input_len=256, max_prompt_bytes=32 * 256)
HELLO = [{"role": "user", "content": "Hello"}]


def refused(parse, body: dict, status: int = 400) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, SERVED)
    assert info.value.status == status, info.value.message
    assert info.value.message.startswith(f"{info.value.param}") or info.value.param is None, info.value.message
    assert "\n" not in info.value.message
    return info.value


def test_a_text_completion_with_openai_defaults():
    parsed = parse_completion({"model": "tiny-chat", "prompt": "def f(x):"}, SERVED)
    # OpenAI's defaults, not the Triton model's: 16 tokens, temperature 1
    assert parsed.inputs == {"text_input": "def f(x):", "max_tokens": COMPLETION_MAX_TOKENS, "temperature": 1.0,
                             "max_tokens_fit": True}
    assert not parsed.chat and not parsed.stream and not parsed.include_usage and parsed.stop == ()


def test_sampling_values_and_the_extensions_reach_triton():
    parsed = parse_completion({"prompt": "x", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 2**64 - 1,
                               "top_k": 3, "num_draft_tokens": 0, "user": "someone", "stop": "\n\n",
                               "cache_salt": "tenant-7"}, SERVED)
    assert parsed.inputs == {"text_input": "x", "max_tokens": 7, "temperature": 0.0, "top_p": 0.5,
                             "seed": 2**64 - 1, "top_k": 3, "num_draft_tokens": 0, "cache_salt": "tenant-7"}
    assert parsed.stop == ("\n\n",)
    for salt in ("", 7, ["a"]):
        assert refused(parse_completion, {"prompt": "x", "cache_salt": salt}).param == "cache_salt"


@pytest.mark.parametrize("prompt, name, value", [
    ([5, 6, 7], "input_ids", [5, 6, 7]),
    ([[5, 6]], "input_ids", [5, 6]),
    (["text"], "text_input", "text"),
], ids=["ids", "one-list-of-ids", "one-string-in-a-list"])
def test_one_prompt_in_any_of_openais_shapes(prompt, name, value):
    assert parse_completion({"prompt": prompt}, SERVED).inputs[name] == value


@pytest.mark.parametrize("prompt, words", [
    (["a", "b"], "2 prompts in one request"),
    ([[1], [2], [3]], "3 prompts in one request"),
    ([], "non-empty list of token ids"),
    ([1, -2], "token id -2 is out of range"),
    ([1, 2**31], "token id 2147483648 is out of range"),
    ([True, 1], "must be a string or a non-empty list"),
    (7, "must be a string"),
], ids=["two-strings", "three-id-lists", "empty", "negative-id", "id-over-int32", "bool-id", "number"])
def test_bad_prompts(prompt, words):
    error = refused(parse_completion, {"prompt": prompt})
    assert error.param == "prompt" and words in error.message


def test_a_completion_needs_a_prompt_and_a_chat_needs_messages():
    assert refused(parse_completion, {"max_tokens": 3}).param == "prompt"
    assert refused(parse_chat, {"max_tokens": 3}).param == "messages"


@pytest.mark.parametrize("field, value", [("best_of", 3), ("echo", True), ("suffix", "}")])
def test_completion_fields_that_would_change_the_output_are_refused(field, value):
    error = refused(parse_completion, {"prompt": "x", field: value})
    assert error.param == field and error.code == "unsupported_parameter"
    assert "not supported" in error.message and ("leave it" in error.message or "instead" in error.message
                                                 or "yourself" in error.message or "use n" in error.message)


@pytest.mark.parametrize("field, value", [
    ("modalities", ["text", "audio"]), ("prediction", {"x": 1}), ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
])
def test_chat_fields_that_would_change_the_output_are_refused(field, value):
    error = refused(parse_chat, {"messages": HELLO, field: value})
    assert error.param == field and error.code == "unsupported_parameter"


def test_output_controls_become_the_models_inputs():
    body = {"prompt": "x", "n": 3, "seed": 2**64 - 2, "logprobs": 2, "presence_penalty": 0.5, "frequency_penalty": -1,
            "repetition_penalty": 1.2, "logit_bias": {"50256": -100}, "min_tokens": 3, "ignore_eos": True,
            "response_format": {"type": "json_object"}}
    parsed = parse_completion(body, SERVED)
    assert parsed.n == 3 and parsed.logprobs and parsed.tool_format is None
    inputs = parsed.inputs
    assert (inputs["presence_penalty"], inputs["frequency_penalty"], inputs["repetition_penalty"]) == (0.5, -1.0, 1.2)
    assert (inputs["logprobs"], inputs["min_tokens"], inputs["ignore_eos"]) == (2, 3, True)
    assert json.loads(inputs["logit_bias"]) == {"50256": -100}
    assert json.loads(inputs["response_format"]) == {"type": "json_object"}
    # each choice its own seed, so one seed reproduces all n and they differ
    assert [parsed.choice_inputs(i)["seed"] for i in range(3)] == [2**64 - 2, 2**64 - 1, 0]
    plain = parse_completion({"prompt": "x", "n": 2}, SERVED)
    assert "seed" not in plain.choice_inputs(1) and "logprobs" not in plain.inputs and not plain.logprobs


def test_chat_logprobs_and_tools():
    assert parse_chat({"messages": HELLO, "logprobs": True, "top_logprobs": 4}, SERVED).inputs["logprobs"] == 4
    assert parse_chat({"messages": HELLO, "logprobs": True}, SERVED).inputs["logprobs"] == 0
    assert "logprobs" not in parse_chat({"messages": HELLO, "logprobs": False}, SERVED).inputs
    assert refused(parse_chat, {"messages": HELLO, "top_logprobs": 2}).param == "top_logprobs"
    assert refused(parse_chat, {"messages": HELLO, "logprobs": 1}).param == "logprobs"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    error = refused(parse_chat, {"messages": HELLO, "tools": tools})  # SERVED's template has no tool format
    assert error.param == "tools" and "does not render tools" in error.message
    hermes = dataclasses.replace(SERVED, tool_format="hermes")
    parsed = parse_chat({"messages": HELLO, "tools": tools, "tool_choice": "auto"}, hermes)
    assert json.loads(parsed.inputs["tools"]) == tools and parsed.tool_format == "hermes"
    assert parse_chat({"messages": HELLO, "tools": tools, "tool_choice": "none"}, hermes).tool_format is None
    assert refused(parse_chat, {"messages": HELLO, "tool_choice": "required"}).param == "tool_choice"
    # an agent loop sends back the calls and their results; the model checks them
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]
    loop = [*HELLO, {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    sent = json.loads(parse_chat({"messages": loop, "tools": tools}, hermes).inputs["messages"])
    assert sent[1]["tool_calls"] == calls and sent[2]["tool_call_id"] == "call_1"


@pytest.mark.parametrize("parse, field, value", [
    ("completion", "n", 0), ("completion", "n", 17), ("completion", "n", True), ("completion", "logprobs", 6),
    ("completion", "logit_bias", [1]), ("chat", "response_format", "json"), ("chat", "ignore_eos", "yes"),
    ("chat", "min_tokens", -1), ("chat", "presence_penalty", "high"),
])
def test_output_controls_of_the_wrong_type_are_refused(parse, field, value):
    body = {"prompt": "x"} if parse == "completion" else {"messages": HELLO}
    assert refused(parse_completion if parse == "completion" else parse_chat, {**body, field: value}).param == field


def test_neutral_values_of_unsupported_fields_pass():
    parse_completion({"prompt": "x", "n": 1, "best_of": 1, "echo": False, "logprobs": None, "presence_penalty": 0,
                      "frequency_penalty": 0.0, "logit_bias": {}, "suffix": ""}, SERVED)
    parsed = parse_chat({"messages": HELLO, "n": 1, "logprobs": False, "top_logprobs": None, "tools": [],
                         "tool_choice": "none", "response_format": {"type": "text"}, "parallel_tool_calls": True,
                         "store": False}, SERVED)
    assert "response_format" not in parsed.inputs and "tools" not in parsed.inputs


def test_unknown_and_wrong_endpoint_fields_are_refused_by_name():
    assert refused(parse_completion, {"prompt": "x", "max_token": 5}).message.startswith("max_token: unknown")
    assert refused(parse_completion, {"prompt": "x", "tools": []}).param == "tools"  # a chat field
    assert refused(parse_chat, {"messages": HELLO, "echo": False}).param == "echo"  # a completions field


@pytest.mark.parametrize("field, value, words", [
    ("max_tokens", "10", "must be an integer >= 0"),
    ("max_tokens", 2**31, "at most 2147483647"),
    ("max_tokens", -1, "must be an integer >= 0"),
    ("max_tokens", 3.0, "must be an integer"),
    ("temperature", "hot", "is not a number"),
    ("temperature", True, "is not a number"),
    ("top_p", [1], "is not a number"),
    ("seed", -1, "in [0, 2**64)"),
    ("seed", 2**64, "in [0, 2**64)"),
    ("top_k", 1.5, "must be an integer >= 0"),
    ("num_draft_tokens", -1, "0 = target-only"),
    ("stream", "yes", "must be true or false"),
])
def test_values_that_cannot_become_their_tensor(field, value, words):
    error = refused(parse_completion, {"prompt": "x", field: value})
    assert error.param == field and words in error.message, error.message


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [10**400, -(10**400), 1e39, float("inf"), float("-inf"), float("nan")],
                         ids=["401-digits", "-401-digits", "past-float32", "inf", "-inf", "nan"])
def test_numbers_a_float32_cannot_hold_are_refused(field, value):
    error = refused(parse_completion, {"prompt": "x", field: value})
    assert error.param == field and "is not a finite number within the 32-bit float range" in error.message
    assert len(error.message) < 200  # the 401 digits are cut


def test_value_ranges_are_left_to_the_model():
    # One place for these rules: the Triton model's own checks, whose messages pass through (see the live tests).
    parsed = parse_completion({"prompt": "x", "temperature": -1, "top_p": 7, "num_draft_tokens": 99}, SERVED)
    assert parsed.inputs["temperature"] == -1.0 and parsed.inputs["top_p"] == 7.0


def test_another_model_is_a_404_and_no_model_means_this_one():
    error = refused(parse_completion, {"model": "gpt-4o", "prompt": "x"}, status=404)
    assert error.code == "model_not_found" and "'tiny-chat'" in error.message
    parse_completion({"prompt": "x"}, SERVED)


def test_stream_options():
    parsed = parse_chat({"messages": HELLO, "stream": True, "stream_options": {"include_usage": True}}, SERVED)
    assert parsed.stream and parsed.include_usage
    assert refused(parse_chat, {"messages": HELLO, "stream_options": {"include_usage": True}}).param == \
        "stream_options"  # as OpenAI: only with stream
    assert refused(parse_chat, {"messages": HELLO, "stream": True, "stream_options": {"include_usage": 1}}).param \
        == "stream_options"


@pytest.mark.parametrize("stop, expected", [
    ("###", ("###",)), (["a", "", "b"], ("a", "b")), (None, ()), ([], ()),
])
def test_stop_strings(stop, expected):
    assert parse_completion({"prompt": "x", "stop": stop}, SERVED).stop == expected


@pytest.mark.parametrize("stop, words", [
    (["a", "b", "c", "d", "e"], "5 stop strings; send at most 4"),
    (["x" * 2000], "over the 1024-character limit"),
    ([1], "must be a string or a list of strings"),
])
def test_bad_stop_strings(stop, words):
    assert words in refused(parse_completion, {"prompt": "x", "stop": stop}).message


def test_chat_messages_become_the_models_messages_input():
    messages = [
        {"role": "system", "content": "You write Python.", "name": "setup"},  # the name is not rendered
        {"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}, {"type": "text", "text": "..."}]},
        {"role": "assistant", "content": "return a + b", "refusal": None, "tool_calls": []},  # echoed back, empty
    ]
    parsed = parse_chat({"messages": messages, "temperature": 0}, SERVED)
    assert json.loads(parsed.inputs["messages"]) == [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def add(a, b):\n..."},
        {"role": "assistant", "content": "return a + b"},
    ]
    assert parsed.chat and parsed.inputs["temperature"] == 0.0


@pytest.mark.parametrize("messages, words", [
    ("hello", "expected a list of messages"),
    (["hello"], "messages[0]: 'hello' is not an object"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0]: 'image_url' is not supported"),
    ([{"role": "assistant", "content": None, "function_call": {"name": "f"}}],
     "messages[0].function_call: not supported (send tools and tool_choice instead"),
    ([{"role": "user", "content": "x", "weight": 2}], "messages[0].weight: not supported"),
])
def test_bad_messages(messages, words):
    error = refused(parse_chat, {"messages": messages})
    assert error.param == "messages" and words in error.message, error.message


def test_no_max_tokens_asks_the_model_to_fit_the_default():
    # The proxy cannot count a chat's prompt tokens: the model lowers the default to what its KV pool holds.
    for parse, body in [(parse_chat, {"messages": HELLO}), (parse_completion, {"prompt": "x"})]:
        assert parse(body, SERVED).inputs["max_tokens_fit"] is True
        for given in ("max_tokens", "max_completion_tokens") if parse is parse_chat else ("max_tokens",):
            assert "max_tokens_fit" not in parse({**body, given: 5}, SERVED).inputs


def test_chat_max_tokens():
    assert parse_chat({"messages": HELLO}, SERVED).inputs["max_tokens"] == 512 - 256  # room any accepted prompt leaves
    big = ServedModel("big", max_seq_len=8192, max_input_len=4096, max_prompt_bytes=32 * 4096)
    assert parse_chat({"messages": HELLO}, big).inputs["max_tokens"] == CHAT_MAX_TOKENS_CAP
    assert parse_chat({"messages": HELLO, "max_completion_tokens": 9}, SERVED).inputs["max_tokens"] == 9
    assert parse_chat({"messages": HELLO, "max_tokens": 9, "max_completion_tokens": 9}, SERVED).inputs[
        "max_tokens"] == 9
    error = refused(parse_chat, {"messages": HELLO, "max_tokens": 8, "max_completion_tokens": 9})
    assert error.param == "max_completion_tokens" and "send one of them" in error.message


def test_a_body_that_is_not_an_object():
    assert "expected a JSON object" in refused(parse_completion, ["prompt"]).message
