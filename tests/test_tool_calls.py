"""pipeline/tool_calls.py: the template's tool format, checked tools / tool_choice, and model output parsed into
tool_calls, in one piece and streamed at every split point."""

from __future__ import annotations

import json
import re

import pytest

from pipeline.executor import RequestError
from pipeline.tool_calls import (MAX_TOOLS, ToolCall, ToolCallStream, parse_tool_calls, tool_format,
                                 validate_tool_choice, validate_tools)

# Excerpts of the real templates' tool parts (Qwen2.5, Llama 3.1, Mistral v3).
QWEN = ('{%- if tools %}{{- "<tools>" }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}'
        '{{- "</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
        '<tool_call></tool_call> XML tags" }}{%- endif %}')
LLAMA = ('{%- if tools is not none %}{{- \'Respond in the format {"name": function name, "parameters": dictionary '
         'of argument name and its value}.\' }}{%- endif %}{{- "<|python_tag|>" + tool_call.name }}')
LLAMA_32 = ('{%- if tools is not none %}{{- \'Respond in the format {"name": function name, "parameters": '
            'dictionary of argument name and its value}.\' }}{%- endif %}')
MISTRAL = ('{%- if tools is not none %}{{- "[AVAILABLE_TOOLS] [" }}{%- endif %}'
           '{%- if message.tool_calls is defined %}{{- "[TOOL_CALLS] [" }}{%- endif %}')
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize("template, expected", [
    (QWEN, "hermes"), (LLAMA, "llama3_json"), (LLAMA_32, "llama3_json"), (MISTRAL, "mistral"),
    (CHATML, None), (None, None), ("", None),
    ("{% if tools %}{{ tools | tojson }}{% endif %}<tool_call>", "hermes"),
    ("{# no tools here #}<tool_call>", None),  # the marker alone: the template never renders tools
])
def test_the_format_is_read_from_the_template_text(template, expected):
    assert tool_format(template) == expected


HERMES_TWO = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET", "n": [1, 2]}}\n</tool_call>')
CASES = {  # (format, model output, expected content, expected [(name, arguments)])
    "hermes-two": ("hermes", HERMES_TWO, "Let me check both.",
                   [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET", "n": [1, 2]})]),
    "hermes-unclosed": ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}', None, [("f", {})]),
    "hermes-string-args": ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None,
                           [("f", {"a": 1})]),
    "hermes-bad-json": ("hermes", 'Hi <tool_call>{"name": "f", "arguments": {oops}</tool_call> there',
                        'Hi <tool_call>{"name": "f", "arguments": {oops}</tool_call> there', []),
    "hermes-no-name": ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
                       []),
    "hermes-bad-then-good": ("hermes", '<tool_call>[1]</tool_call><tool_call>{"name": "g", "arguments": {}}'
                             '</tool_call>', "<tool_call>[1]</tool_call>", [("g", {})]),
    "hermes-plain": ("hermes", "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool "
                     "is not a tag.", []),
    "llama-bare": ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
                   [("get_weather", {"city": "Oslo"})]),
    "llama-two": ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": '
                  '{}}', None, [("a", {"x": 1}), ("b", {})]),
    "llama-after-text": ("llama3_json", 'Sure.<|python_tag|>{"name": "a", "parameters": {}}', "Sure.", [("a", {})]),
    "llama-json-answer": ("llama3_json", '{"answer": 42} is the JSON you asked for', '{"answer": 42} is the JSON you '
                          'asked for', []),
    "llama-brace-later": ("llama3_json", 'Use {"name": "a", "parameters": {}} like this', 'Use {"name": "a", '
                          '"parameters": {}} like this', []),
    "llama-bad-json": ("llama3_json", '{"name": "a", "parameters": {', '{"name": "a", "parameters": {', []),
    "mistral-list": ("mistral", 'On it. [TOOL_CALLS] [{"name": "a", "arguments": {"q": "x"}}, {"name": "b", '
                     '"arguments": {}, "id": "abcdefghi"}]', "On it.", [("a", {"q": "x"}), ("b", {})]),
    "mistral-v11": ("mistral", '[TOOL_CALLS]a{"q": 1}[TOOL_CALLS]b[ARGS]{}', None, [("a", {"q": 1}), ("b", {})]),
    "mistral-bad": ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": 3}]', '[TOOL_CALLS] [{"name": "a", '
                    '"arguments": 3}]', []),
    "mistral-truncated": ("mistral", '[TOOL_CALLS] [{"name": "a", "argu', '[TOOL_CALLS] [{"name": "a", "argu', []),
}


def _named(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("case", list(CASES))
def test_one_shot_parse(case):
    fmt, text, content, calls = CASES[case]
    got_content, got_calls = parse_tool_calls(text, fmt)
    assert got_content == content
    assert _named(got_calls) == calls
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


def _stream(fmt: str, pieces: list[str]) -> tuple[str, list[tuple[str, dict]], list]:
    stream = ToolCallStream(fmt)
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.finish()
    content = "".join(d for d in deltas if isinstance(d, str))
    calls: dict[int, dict] = {}
    for d in (d for d in deltas if isinstance(d, dict)):
        if "id" in d:  # the first delta of a call names it
            assert d["index"] == len(calls) and d["type"] == "function" and d["function"]["arguments"] == ""
            calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()], deltas


@pytest.mark.parametrize("case", list(CASES))
def test_streaming_split_anywhere_gives_the_one_shot_result(case):
    fmt, text, content, calls = CASES[case]
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        got_content, got_calls, _ = _stream(fmt, pieces)
        assert (got_content.strip() if calls else got_content) == (content or ""), pieces
        assert got_calls == calls, pieces


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][3] and not re.search(r"[<\[]", CASES[c][2] or "")])
def test_markers_never_leak_into_streamed_content(case):
    fmt, text, _, calls = CASES[case]
    for pieces in [list(text)] + [[text[:i], text[i:]] for i in range(len(text))]:
        _, _, deltas = _stream(fmt, pieces)
        streamed = "".join(d for d in deltas if isinstance(d, str))
        for marker in ("<tool", "tool_call", "[TOOL", "python_tag", '"name"', "</"):
            assert marker not in streamed, (pieces, streamed)


def test_a_call_is_streamed_as_soon_as_it_closes_and_the_prefix_is_held_back():
    stream = ToolCallStream("hermes")
    assert stream.feed("Checking <tool_") == ["Checking "]
    assert stream.feed('call>{"name": "f", "arguments": {"a": 1}}') == []
    first, rest, after = stream.feed("</tool_call> done <")
    assert first["function"] == {"name": "f", "arguments": ""} and first["index"] == 0
    assert rest == {"index": 0, "function": {"arguments": '{"a": 1}'}}
    assert after == " done " and stream.finish() == ["<"]
    assert [c.name for c in stream.calls] == ["f"] and stream.calls[0].id == first["id"]
    # A near miss is released once it cannot be a marker any more, not only at the end.
    stream = ToolCallStream("hermes")
    assert stream.feed("a <tool") == ["a "] and stream.feed("box>") == ["<toolbox>"]


def test_an_unknown_format_is_a_value_error():
    with pytest.raises(ValueError, match="not one of hermes"):
        ToolCallStream("xml")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_valid_tools_are_copied_without_strict():
    (tool,) = validate_tools([WEATHER])
    assert tool == {"type": "function", "function": {k: v for k, v in WEATHER["function"].items() if k != "strict"}}
    assert validate_tools(None) == [] and validate_tools([]) == []


def _fn(**function):
    return {"type": "function", "function": function}


@pytest.mark.parametrize("tools, path, words", [
    ({"name": "f"}, "tools", "expected a list"),
    ([WEATHER, WEATHER, _fn(name="x y")], r"tools\[1\]\.function\.name", "declared twice"),
    ([WEATHER, _fn(name="ok"), _fn(name="bad name")], r"tools\[2\]\.function\.name", "'bad name'.*rename"),
    ([_fn(name="a" * 65)], r"tools\[0\]\.function\.name", "1 to 64"),
    ([{"type": "retrieval"}], r"tools\[0\]", "type.: .function"),
    ([_fn(name="f", parameters="{}")], r"tools\[0\]\.function\.parameters", "JSON Schema object"),
    ([_fn(name="f", description=3)], r"tools\[0\]\.function\.description", "must be a string"),
    ([_fn(name="f", examples=[])], r"tools\[0\]\.function\.examples", "not a function field"),
    ([_fn(name=f"f{i}") for i in range(MAX_TOOLS + 1)], "tools", "at most 128"),
    ([_fn(name="f", description="d" * 70_000)], "tools", "exceed 65536 characters"),
    ([_fn(name="f", parameters={"a": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]})],
     r"tools\[0\]\.function\.parameters", "deeper than 32"),
])
def test_bad_tools_name_the_field_the_value_and_the_fix(tools, path, words):
    with pytest.raises(RequestError, match=f"^{path}: .*{words}") as caught:
        validate_tools(tools)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 300


def test_tool_choice():
    tools = validate_tools([WEATHER])
    assert validate_tool_choice(None, tools) == "auto" and validate_tool_choice(None, []) == "none"
    for choice in ("none", "auto", "required"):
        assert validate_tool_choice(choice, tools) == choice
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert validate_tool_choice(named, tools) == named
    assert validate_tool_choice("none", []) == "none" and validate_tool_choice("auto", []) == "none"
    for choice, words in [("always", "is not a tool choice"), ("required", "needs tools"),
                          ({"type": "function", "function": {"name": "get_time"}},
                           "names no declared tool.*get_weather"),
                          ({"type": "function", "name": "get_weather"}, "is not a tool choice")]:
        with pytest.raises(RequestError, match=f"^tool_choice.*{words}"):
            validate_tool_choice(choice, [] if choice == "required" else tools)


def test_a_required_call_is_a_grammar_of_the_allowed_tools(tiny_pair):
    """tool_choice "required" or a named tool becomes a response_format whose only answers are one call in the
    template's format: the matcher takes a valid call token by token, refuses another tool's name, and the parser
    reads the call back."""
    from transformers import AutoTokenizer

    from pipeline.speculative.grammar import GrammarCompiler, grammar_from_response_format
    from pipeline.tool_calls import forced_call_format

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
                 "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                 "additionalProperties": False}}},
             {"type": "function", "function": {"name": "get_time"}}]
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair / "target")
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    weather = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    for choice, fmt, text, fits in [
        ("required", "hermes", f"<tool_call>\n{weather}\n</tool_call>", True),
        ({"type": "function", "function": {"name": "get_weather"}}, "hermes", f"<tool_call>\n{weather}\n</tool_call>",
         True),
        ({"type": "function", "function": {"name": "get_time"}}, "hermes", f"<tool_call>\n{weather}\n</tool_call>",
         False),
        ("required", "llama3_json", '{"name": "get_time", "parameters": {}}', True),
        ("required", "hermes", "It is sunny.", False),
    ]:
        matcher = compiler.matcher(grammar_from_response_format(forced_call_format(tools, choice, fmt)))
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        rows = matcher.allowed_along(ids[:-1])
        accepted = all(bool(rows[i, token]) for i, token in enumerate(ids))
        assert accepted == fits, (choice, fmt, text)
        if fits:
            content, (call,) = parse_tool_calls(text, fmt)
            assert content is None and call.name in ("get_weather", "get_time")
    assert forced_call_format(tools, "auto", "hermes") is None and forced_call_format(tools, "required", "mistral") \
        is None
