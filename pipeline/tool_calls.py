"""OpenAI tool calling: which format a chat template's model calls tools in, checked ``tools`` / ``tool_choice``, and
the model's output parsed into ``tool_calls``, in one piece or incrementally while it streams.

The formats, as the real templates write them (and so as their models were trained to answer):

- ``hermes`` (Qwen2.5/Qwen3, Hermes 2/3, SmolLM3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call; text before a block is content;
- ``llama3_json`` (Llama 3.1/3.2/3.3): a bare ``{"name": ..., "parameters": {...}}`` object as the whole answer,
  optionally after ``<|python_tag|>``; several calls are separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list ``[{"name": ..., "arguments": {...}}, ...]`` (or the newer
  ``[TOOL_CALLS]name{...}`` / ``[TOOL_CALLS]name[ARGS]{...}``, one marker per call).

Model output is never an error: a call that does not parse (bad JSON, no name, arguments that are no object) stays
in the content as the model wrote it. The one-shot parse is the stream fed in one piece, so both always agree.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from .errors import short_repr
from .errors import RequestError
from .speculative.sampling_params import JSON_LAYOUT

TOOL_FORMATS = ("hermes", "llama3_json", "mistral")
MAX_TOOLS = 128
MAX_TOOLS_JSON_CHARS = 64 * 1024  # all tool definitions as JSON text
MAX_JSON_DEPTH = 32  # nesting of a schema or of arguments (the template renderer recurses over it)
NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
TOOL_CHOICES = ("none", "auto", "required")
FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
MARKERS = {"hermes": HERMES_OPEN, "llama3_json": PYTHON_TAG, "mistral": MISTRAL_CALLS}

# A content delta is its text; a tool-call delta is OpenAI's streaming shape (see ToolCallStream).
Delta = str | dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    id: str  # "call_" + 24 hex characters
    name: str
    arguments: str  # JSON object text


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _uses_tools(chat_template: str) -> bool:
    """Whether the template's code (not its comments or literal text) reads the ``tools`` variable."""
    code = re.findall(r"\{%.*?%\}|\{\{.*?\}\}", re.sub(r"\{#.*?#\}", "", chat_template, flags=re.S), flags=re.S)
    return any(re.search(r"(?<![\w.'\"])tools\b(?!['\"])", block) for block in code)


def tool_format(chat_template: str | None) -> str | None:
    """The tool-call format of the model behind ``chat_template`` (one of TOOL_FORMATS), read from the template's
    text; None when the template does not render ``tools`` or writes calls in a format this module cannot parse."""
    if not chat_template or not _uses_tools(chat_template):
        return None
    if HERMES_OPEN in chat_template:
        return "hermes"
    if MISTRAL_CALLS in chat_template:
        return "mistral"
    if PYTHON_TAG in chat_template or '"parameters": ' in chat_template:  # the instruction, or a call's render
        return "llama3_json"
    return None


def json_depth(value: object, limit: int = MAX_JSON_DEPTH) -> int:
    """How deeply lists and dicts nest in ``value`` (0 for a scalar), without recursion; counting stops past
    ``limit``."""
    depth, level = 0, [value]
    while depth <= limit:
        containers = [item for item in level if isinstance(item, (list, tuple, dict))]
        if not containers:
            break
        depth += 1
        level = [v for c in containers for v in (c.values() if isinstance(c, dict) else c)]
    return depth


def _fail(path: str, value: object, problem: str, fix: str) -> RequestError:
    return RequestError(f"{path}: {problem} (got {short_repr(value, 60)}); {fix}")


def _check_function(function: object, path: str) -> dict[str, Any]:
    if not isinstance(function, dict):
        raise _fail(path, function, "expected an object", 'write {"name": "get_weather", "parameters": {...}}')
    extra = sorted(set(function) - FUNCTION_KEYS)
    if extra:
        raise _fail(f"{path}.{extra[0]}", function[extra[0]], "is not a function field",
                    "use only name, description, parameters and strict")
    name = function.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise _fail(f"{path}.name", name, "must be 1 to 64 letters, digits, '_' or '-'", "rename the function")
    checked: dict[str, Any] = {"name": name}
    description = function.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise _fail(f"{path}.description", description, "must be a string", "describe the function in text")
        checked["description"] = description
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise _fail(f"{path}.parameters", parameters, "must be a JSON Schema object",
                        'write {"type": "object", "properties": {...}}')
        if json_depth(parameters) > MAX_JSON_DEPTH:
            raise _fail(f"{path}.parameters", parameters, f"nests deeper than {MAX_JSON_DEPTH} levels",
                        "flatten the schema")
        checked["parameters"] = parameters
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _fail(f"{path}.strict", strict, "must be true or false", "leave it out or send a boolean")
    return checked


def validate_tools(value: object) -> list[dict]:
    """A checked copy of a request's ``tools``: ``[{"type": "function", "function": {"name", "description"?,
    "parameters"?}}]`` ([] for None). ``strict`` is accepted and dropped: the schema is shown to the model, not
    enforced. Raises RequestError naming the field path, the bad value and the fix."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise _fail("tools", value, "expected a list of tools", 'send [{"type": "function", "function": {...}}]')
    if len(value) > MAX_TOOLS:
        raise _fail("tools", f"{len(value)} tools", f"at most {MAX_TOOLS} tools are accepted", "send fewer tools")
    checked, names = [], set()
    for i, tool in enumerate(value):
        path = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) != {"type", "function"}:
            raise _fail(path, tool, 'expected {"type": "function", "function": {...}} and no other keys',
                        "write each tool in OpenAI's function shape")
        function = _check_function(tool["function"], f"{path}.function")
        if function["name"] in names:
            raise _fail(f"{path}.function.name", function["name"], "is declared twice", "give each tool its own name")
        names.add(function["name"])
        checked.append({"type": "function", "function": function})
    try:
        size = len(json.dumps(checked, ensure_ascii=False))
    except (TypeError, ValueError) as exc:
        raise _fail("tools", value, f"is not JSON data ({exc})", "send plain JSON values") from None
    if size > MAX_TOOLS_JSON_CHARS:
        raise _fail("tools", f"{size} characters of JSON", f"the tools exceed {MAX_TOOLS_JSON_CHARS} characters",
                    "shorten the descriptions and schemas or send fewer tools")
    return checked


def validate_tool_choice(value: object, tools: list[dict]) -> str | dict:
    """A checked ``tool_choice``: "none", "auto", "required" or ``{"type": "function", "function": {"name": N}}``
    naming one of ``tools`` (checked ones). None means OpenAI's default: "auto" with tools, "none" without; "auto"
    without tools is "none" too (nothing to call), while "required" and a named tool need tools."""
    if value is None:
        return "auto" if tools else "none"
    names = [tool["function"]["name"] for tool in tools]
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise _fail("tool_choice", value, "is not a tool choice", "use none, auto, required or "
                        '{"type": "function", "function": {"name": ...}}')
        if value == "required" and not tools:
            raise _fail("tool_choice", value, "needs tools", "declare them in tools or leave tool_choice out")
        return value if tools else "none"
    function = value.get("function") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or set(value) != {"type", "function"} \
            or not isinstance(function, dict) or set(function) != {"name"}:
        raise _fail("tool_choice", value, "is not a tool choice",
                    'name a function as {"type": "function", "function": {"name": ...}}')
    if function["name"] not in names:
        raise _fail("tool_choice.function.name", function["name"], "names no declared tool",
                    f"pick one of {', '.join(names) or '(none: declare tools first)'}")
    return {"type": "function", "function": {"name": function["name"]}}


# The formats whose calls are plain text around one JSON object (a Mistral call opens with a special token, which a
# text grammar cannot write): the text before and after the object, and the key holding the arguments.
CALL_LAYOUTS = {"hermes": ("<tool_call>\n", "\n</tool_call>", "arguments"), "llama3_json": ("", "", "parameters")}


def forced_call_format(tools: list[dict], tool_choice: str | dict, fmt: str | None) -> dict | None:
    """A response_format (a Lark grammar) under which the answer is one call, in ``fmt``, of a tool ``tool_choice``
    allows: any of ``tools`` for "required", the named one for a named choice; its arguments follow the tool's
    parameters schema. None where nothing is forced ("auto", "none") or ``fmt`` cannot be written as text."""
    if tool_choice in ("auto", "none") or fmt not in CALL_LAYOUTS:
        return None
    before, after, key = CALL_LAYOUTS[fmt]
    named = None if tool_choice == "required" else tool_choice["function"]["name"]
    calls = [{"type": "object", "properties": {"name": {"const": tool["function"]["name"]},
                                               key: _closed(tool["function"].get("parameters"))},
              "required": ["name", key], "additionalProperties": False}
             for tool in tools if named in (None, tool["function"]["name"])]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_LAYOUT}
    parts = [json.dumps(text) for text in (before, after) if text]
    body = " ".join([parts[0], "call", parts[1]] if parts else ["call"])
    return {"type": "grammar", "grammar": f"start: {body}\ncall: %json {json.dumps(schema)}\n"}


def _closed(parameters: dict | None) -> dict:
    """A forced call's arguments schema: the tool's, holding only its declared properties unless it says otherwise
    (as OpenAI's strict mode requires; an open object lets a model write keys until its token limit)."""
    schema = dict(parameters or {"type": "object"})
    if schema.get("type") == "object":
        schema.setdefault("additionalProperties", False)
    return schema


def _call(obj: object, args_key: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a decoded call object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def _decode(text: str, start: int) -> tuple[object, int] | None:
    """The JSON value at ``text[start]`` and where it ends; None while it is incomplete or invalid."""
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except (ValueError, RecursionError):
        return None


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


# Each taker reads the text at a marker (or, for Llama, a bare "{"): (consumed, calls) once decided, with calls None
# for "not a call: the consumed text is content"; None while more text could change the decision.
Take = tuple[int, list[tuple[str, str]] | None] | None


def _take_hermes(text: str, final: bool) -> Take:
    end = text.find(HERMES_CLOSE)
    if end < 0 and not final:
        return None
    consumed = len(text) if end < 0 else end + len(HERMES_CLOSE)
    body = text[len(HERMES_OPEN):end if end >= 0 else len(text)].strip()
    decoded = _decode(body, 0) if body.startswith("{") else None
    call = _call(decoded[0], "arguments") if decoded and decoded[1] == len(body) else None
    return consumed, [call] if call else None


def _take_llama(text: str, final: bool) -> Take:
    at = _skip_space(text, len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0)
    if at == len(text):
        return None if not final else (len(text), None)
    if text[at] != "{":  # Llama 3.1's built-in tools (``brave_search.call(...)``) are not parsed: content
        return at, None
    decoded = _decode(text, at)
    if decoded is None:
        return (len(text), None) if final else None
    call = _call(decoded[0], "parameters")
    return (decoded[1], [call]) if call else (decoded[1], None)


def _take_mistral(text: str, final: bool) -> Take:
    at = _skip_space(text, len(MISTRAL_CALLS))
    if at == len(text):
        return None if not final else (len(text), None)
    if text[at] == "[":
        decoded = _decode(text, at)
        if decoded is None:
            return (len(text), None) if final else None
        calls = [_call(obj, "arguments") for obj in decoded[0]] if isinstance(decoded[0], list) else [None]
        return decoded[1], (calls if calls and all(calls) else None)
    name = re.match(r"[a-zA-Z0-9_-]+", text[at:])
    if name is None:
        return at, None
    args_at = at + name.end() if name else at
    if text.startswith(MISTRAL_ARGS, args_at):
        args_at += len(MISTRAL_ARGS)
    decoded = _decode(text, args_at) if text.startswith("{", args_at) else None
    if decoded is None:
        return (len(text), None) if final else None
    call = _call({"name": name.group(), "arguments": decoded[0]}, "arguments")
    return decoded[1], [call] if call else None


TAKERS = {"hermes": _take_hermes, "llama3_json": _take_llama, "mistral": _take_mistral}


def _held_back(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolCallStream:
    """Model output in pieces -> content text and tool-call deltas, as OpenAI streams them.

    A call's deltas come once the call is complete (its closing tag or its whole JSON has arrived): first
    ``{"index": i, "id": ..., "type": "function", "function": {"name": ..., "arguments": ""}}``, then
    ``{"index": i, "function": {"arguments": "<JSON text>"}}``. Text that could still become a marker is held
    back, so no part of a marker is ever streamed as content when it turns into a call; ``finish()`` releases
    what is left. ``calls`` lists the calls so far.
    """

    def __init__(self, fmt: str):
        if fmt not in TAKERS:
            raise ValueError(f"tool format {fmt!r} is not one of {', '.join(TOOL_FORMATS)}")
        self.fmt = fmt
        self.calls: list[ToolCall] = []
        self._take, self._marker = TAKERS[fmt], MARKERS[fmt]
        self._pending = ""
        # start (Llama: a bare "{" opens a call only as the first thing) | content | call | after_call | plain
        self._mode = "start" if fmt == "llama3_json" else "content"
        self._out: list[Delta] = []

    def feed(self, piece: str) -> list[Delta]:
        self._pending += piece
        if self._mode == "call" and not re.search(r"[}\]>]", piece):
            return []  # a call ends with one of these: no need to parse it again (quadratic over a long call)
        return self._drain(final=False)

    def finish(self) -> list[Delta]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Delta]:
        steps = {"start": self._start, "content": self._content, "call": self._call, "after_call": self._after_call,
                 "plain": self._plain}
        while steps[self._mode](final):
            pass
        out, self._out = self._out, []
        return out

    def _emit(self, upto: int) -> None:
        text, self._pending = self._pending[:upto], self._pending[upto:]
        if not text:
            return
        if self._out and isinstance(self._out[-1], str):
            self._out[-1] += text
        else:
            self._out.append(text)

    def _start(self, final: bool) -> bool:
        at = _skip_space(self._pending, 0)
        if at == len(self._pending) and not final:
            return False
        self._emit(at)
        self._mode = "call" if self._pending.startswith("{") else "content"
        return True

    def _content(self, final: bool) -> bool:
        found = self._pending.find(self._marker)
        if found >= 0:
            self._emit(found)
            self._mode = "call"
            return True
        self._emit(len(self._pending) - (0 if final else _held_back(self._pending, self._marker)))
        return False

    def _call(self, final: bool) -> bool:
        taken = self._take(self._pending, final)
        if taken is None:
            return False
        consumed, calls = taken
        if calls is None:  # not a call after all: the model's text, as written
            self._emit(consumed)
            self._mode = "plain" if self.fmt == "llama3_json" else "content"
            return True
        for name, arguments in calls:
            call = ToolCall(new_call_id(), name, arguments)
            index = len(self.calls)
            self.calls.append(call)
            self._out.append({"index": index, "id": call.id, "type": "function",
                              "function": {"name": name, "arguments": ""}})
            self._out.append({"index": index, "function": {"arguments": arguments}})
        self._pending = self._pending[consumed:]
        self._mode = "after_call" if self.fmt == "llama3_json" else "content"
        return True

    def _after_call(self, final: bool) -> bool:
        """Llama: between calls only ";" and spaces (dropped); anything else ends the calls."""
        rest = self._pending.lstrip().lstrip(";").lstrip()
        if not rest or (not final and PYTHON_TAG.startswith(rest)):
            if final:
                self._pending = ""
            return False
        self._pending = rest
        self._mode = "call" if rest.startswith(("{", PYTHON_TAG)) else "plain"
        return True

    def _plain(self, final: bool) -> bool:
        self._emit(len(self._pending))
        return False


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole model answer in format ``fmt``. With calls, the content is the text around them
    with its outer whitespace stripped, None when nothing is left; without, it is ``text`` as is (None if empty)."""
    stream = ToolCallStream(fmt)
    content = "".join(d for d in stream.feed(text) + stream.finish() if isinstance(d, str))
    if stream.calls:
        content = content.strip()
    return content or None, stream.calls
