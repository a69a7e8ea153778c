"""Chat prompts: a list of ``{"role", "content"}`` messages (and OpenAI ``tools``) -> token ids through the
tokenizer's own chat template.

Security: a message is user input, and a user who can get a control token such as ``<|im_end|>`` or
``<|im_start|>system`` tokenized as that token can close their turn and write another role's (a forged system
prompt). So a message's text is always tokenized as plain text: ``apply_chat_template(...,
sanitize_control_tokens=True)`` (transformers 5.24, the pinned release) marks every control token inside the
messages before rendering and encodes the marked ones as ordinary text, while the control tokens the template writes
itself stay tokens. Because marking happens on the messages, not on the rendered text, templates that trim or
otherwise transform the content stay safe, and content without control-token text (nearly all of it) is encoded
exactly as ``apply_chat_template(..., tokenize=True)`` encodes it. Two checks of our own stand beside that:

- roles come from a fixed list, since some templates build control tokens from the role (``'<|' + role + '|>'``),
  which the library's marking cannot see, and messages carry no other keys a template might render unmarked;
- the library marks every string value nested in messages and tools (a call's arguments, a tool's description), but
  not dict keys: the keys a client controls (a tool's schema, a call's parsed arguments) are refused when they hold
  an added token's text;
- the special tokens of the result are counted against the same conversation with every client string replaced by
  a neutral word (contents, arguments, descriptions; names and ids that are plain words stay, templates check them):
  one more means a string slipped through as a control token, and the request is refused.

Tool calls travel as OpenAI sends them (``function.arguments`` is JSON text); templates expect the arguments as a
dict, so JSON-object arguments are parsed for rendering.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from .errors import short_repr
from .executor.results import RequestError
from .tool_calls import MAX_JSON_DEPTH, MAX_TOOLS, NAME_RE, json_depth, tool_format, validate_tools

Message = dict[str, Any]  # role and content strings; an assistant's tool_calls, a tool's tool_call_id
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
NEUTRAL_CONTENT = "x"  # stands in for every client string when the template's own special tokens are counted
CALL_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
PLAIN_WORD_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # names, ids, schema types: kept in the neutral render


def _arguments_for_template(arguments: str, path: str) -> dict | str:
    """A call's JSON-text arguments as templates expect them: the object parsed, other text as it is."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    except RecursionError:
        parsed = None
    if parsed is None or json_depth(parsed) > MAX_JSON_DEPTH:
        raise RequestError(f"{path}: the arguments nest deeper than {MAX_JSON_DEPTH} levels "
                           f"(got {short_repr(arguments, 40)}); flatten them")
    return parsed if isinstance(parsed, dict) else arguments


def _check_tool_calls(calls: object, path: str) -> list[dict]:
    """A checked copy of an assistant message's ``tool_calls`` (OpenAI's shape), arguments parsed for rendering."""
    example = '[{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]'
    if not isinstance(calls, list) or len(calls) > MAX_TOOLS:
        raise RequestError(f"{path} is {short_repr(calls, 60)}; send a list of at most {MAX_TOOLS} calls such as "
                           f"{example}")
    checked = []
    for j, call in enumerate(calls):
        where = f"{path}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or not {"id", "type", "function"} <= set(call) <= {"id", "type", "function",
                                                                                       "index"} \
                or call["type"] != "function" or not isinstance(function, dict) \
                or set(function) != {"name", "arguments"}:
            raise RequestError(f"{where} is {short_repr(call, 60)}; write each call as in {example}")
        if not isinstance(call["id"], str) or not CALL_ID_RE.fullmatch(call["id"]):
            raise RequestError(f"{where}.id is {short_repr(call['id'], 40)}; send the id the call came with "
                               f"(1 to 128 letters, digits, '_', '-', '.' or ':')")
        if not isinstance(function["name"], str) or not NAME_RE.fullmatch(function["name"]):
            raise RequestError(f"{where}.function.name is {short_repr(function['name'], 40)}; send the name of a "
                               f"function (1 to 64 letters, digits, '_' or '-')")
        raw = function["arguments"]
        if isinstance(raw, dict):  # parsed already: a checked conversation checked again (validate, then encode)
            raw = json.dumps(raw, ensure_ascii=False)
        if not isinstance(raw, str):
            raise RequestError(f"{where}.function.arguments is {short_repr(raw, 40)}; send the arguments as JSON "
                               f"text, as the response gave them")
        arguments = _arguments_for_template(raw, f"{where}.function.arguments")
        checked.append({"id": call["id"], "type": "function",
                        "function": {"name": function["name"], "arguments": arguments}})
    return checked


def _check_message(message: object, where: str, i: int) -> Message:
    if not isinstance(message, dict):
        raise RequestError(f"{where}: message {i} is {type(message).__name__} {short_repr(message, 60)}, not "
                           f"an object; write each message as {{\"role\": \"user\", \"content\": \"...\"}}")
    role = message.get("role")
    allowed = {"role", "content"} | {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}.get(role, set())
    extra = sorted(set(message) - allowed)
    if extra:
        raise RequestError(f"{where}: message {i} has key {short_repr(extra[0], 40)}; a message holds only "
                           f"\"role\" and \"content\", an assistant's also \"tool_calls\", a tool's also "
                           f"\"tool_call_id\" (templates would render other keys unchecked)")
    if role not in ROLES:
        raise RequestError(f"{where}: message {i} role {short_repr(role, 40)} is not one of "
                           f"{', '.join(ROLES)}; use one of them")
    checked: Message = {"role": role}
    calls = message.get("tool_calls")
    if calls not in (None, []):
        checked["tool_calls"] = _check_tool_calls(calls, f"{where}: message {i} tool_calls")
    content = message.get("content")
    if content is None and "tool_calls" in checked:
        content = ""  # OpenAI sends null content beside tool calls
    if not isinstance(content, str):
        got = "missing" if "content" not in message else f"{type(content).__name__} {short_repr(content, 40)}"
        raise RequestError(f"{where}: message {i} content is {got}; it must be a string (the message text)")
    checked["content"] = content
    if "tool_call_id" in message:
        call_id = message["tool_call_id"]
        if not isinstance(call_id, str) or not CALL_ID_RE.fullmatch(call_id):
            raise RequestError(f"{where}: message {i} tool_call_id is {short_repr(call_id, 40)}; send the id of "
                               f"the call this message answers")
        checked["tool_call_id"] = call_id
    return checked


def validate_messages(messages: object, where: str = "messages") -> list[Message]:
    """A checked copy of ``messages``: a non-empty list of ``{"role": ROLE, "content": TEXT}`` dicts; an assistant
    message may add ``tool_calls`` (then its content may be null), a tool message ``tool_call_id``.

    ``where`` names the source in errors (an input name, a file and line); raises RequestError naming the message
    index, the bad value and the fix.
    """
    example = '[{"role": "user", "content": "Hello"}]'
    if not isinstance(messages, (list, tuple)):
        raise RequestError(f"{where}: expected a JSON list of messages such as {example}, got "
                           f"{type(messages).__name__} {short_repr(messages, 60)}")
    if not messages:
        raise RequestError(f"{where}: the message list is empty; send at least one message such as {example}")
    return [_check_message(message, where, i) for i, message in enumerate(messages)]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _source(tokenizer, source: str | None) -> str:
    return source or getattr(tokenizer, "name_or_path", "") or "this model"


def require_chat_template(tokenizer, source: str | None = None) -> None:
    """Raise RequestError naming the fix when the tokenizer has no chat template."""
    if tokenizer is None:
        raise RequestError(f"messages: {_source(tokenizer, source)} has no tokenizer, so a chat cannot be encoded; "
                           f"send token ids instead")
    if not has_chat_template(tokenizer):
        raise RequestError(f"messages: the tokenizer in {_source(tokenizer, source)} has no chat template; use "
                           f"--prompt (or text_input) with raw text, or pick an instruct model whose "
                           f"tokenizer_config.json (or chat_template.jinja) has chat_template")


def chat_tool_format(tokenizer) -> str | None:
    """The tool-call format of the tokenizer's chat template (pipeline.tool_calls.tool_format); None without a
    template or when the template renders no tools."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: apply_chat_template picks "tool_use" when tools are given
        template = template.get("tool_use") or template.get("default")
    return tool_format(template) if isinstance(template, str) else None


def _render_ids(tokenizer, messages: list[Message], add_generation_prompt: bool, source: str | None,
                tools: list[dict] | None = None) -> list[int]:
    from jinja2 import TemplateError

    extra = {"tools": tools} if tools else {}
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            return_dict=False, sanitize_control_tokens=True, **extra)
    except TemplateError as exc:  # the template's own raise_exception: roles out of order, a role it lacks, ...
        raise RequestError(f"messages: the chat template of {_source(tokenizer, source)} refused this conversation "
                           f"({exc}); change the messages as it says") from None
    except ValueError as exc:  # "Can't sanitize ...": the tokenizer makes a control token from plain text
        raise RequestError(f"messages: {exc}; remove that text from the message or tool definition") from None
    return [int(t) for t in out]


def _special_ids(tokenizer) -> frozenset[int]:
    found = set(tokenizer.all_special_ids)
    found.update(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    return frozenset(found)


def _added_texts(tokenizer) -> tuple[str, ...]:
    """Every added token's text (special or not), the whitespace ones aside: what a client string must not hold
    where the library does not mark it."""
    return tuple(t.content for t in tokenizer.added_tokens_decoder.values() if t.content and not t.content.isspace())


def _refuse_marked_keys(messages: list[Message], tools: list[dict] | None, added: tuple[str, ...]) -> None:
    """Dict keys are not marked by sanitize_control_tokens: refuse any key (a schema's property, an argument's
    name) holding an added token's text, naming where it is."""
    stack: list[tuple[object, str]] = [(messages, "messages"), (tools or [], "tools")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                token = next((t for t in added if t in str(key)), None)
                if token is not None:
                    raise RequestError(f"{path}: the key {short_repr(key, 60)} holds the control token {token!r}, "
                                       f"which only the chat template may write; rename the key")
                stack.append((item, f"{path}.{key}"))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))


def _neutral(value: Any, added: tuple[str, ...]) -> Any:
    """``value`` with every string a neutral word, except plain words (names, ids, schema types) that hold no
    added token's text: templates test those (Mistral's 9-character call ids), and none can be a control token."""
    if isinstance(value, str):
        plain = PLAIN_WORD_RE.fullmatch(value) and not any(t in value for t in added)
        return value if plain else NEUTRAL_CONTENT
    if isinstance(value, dict):
        return {key: _neutral(item, added) for key, item in value.items()}
    if isinstance(value, list):
        return [_neutral(item, added) for item in value]
    return value


def _neutral_message(message: Message, added: tuple[str, ...]) -> Message:
    neutral = _neutral(message, added)
    neutral["role"] = message["role"]
    neutral["content"] = NEUTRAL_CONTENT if message["content"] or "tool_calls" not in message else ""
    return neutral


def _require_tool_format(tokenizer, source: str | None) -> None:
    if chat_tool_format(tokenizer) is None:
        raise RequestError(f"tools: the chat template of {_source(tokenizer, source)} does not render tools in a "
                           f"tool-call format this server parses (hermes, llama3_json, mistral); leave tools out, "
                           f"or serve a model whose chat template supports tool calling")


def encode_chat(tokenizer, messages: Sequence[Message], add_generation_prompt: bool = True,
                source: str | None = None, tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template, every client string as plain text.

    ``add_generation_prompt`` appends the template's "assistant turn starts here" text, so the model replies
    rather than continuing the last message. ``source`` names the model in errors (default: the tokenizer's
    folder). ``tools`` (OpenAI's shape, pipeline.tool_calls.validate_tools) are rendered by the template; a template
    without a known tool-call format (chat_tool_format) refuses them. Raises RequestError for malformed messages or
    tools, a tokenizer without a chat template, a template that refuses the conversation, or a client string that
    would become a control token.
    """
    checked = validate_messages(messages)
    require_chat_template(tokenizer, source)
    tools = validate_tools(tools) or None
    if tools:
        _require_tool_format(tokenizer, source)
    added = _added_texts(tokenizer)
    _refuse_marked_keys(checked, tools, added)
    ids = _render_ids(tokenizer, checked, add_generation_prompt, source, tools)
    # Independent of the library's marking: the template alone decides how many special tokens there are.
    special = _special_ids(tokenizer)
    neutral = [_neutral_message(m, added) for m in checked]
    neutral_tools = _neutral(tools, added)
    expected = Counter(t for t in _render_ids(tokenizer, neutral, add_generation_prompt, source, neutral_tools)
                       if t in special)
    found = Counter(t for t in ids if t in special)
    extra = found - expected
    if extra:
        token = tokenizer.convert_ids_to_tokens(next(iter(extra)))
        raise RequestError(f"messages: a message's or tool's text was encoded as the control token {token!r}, "
                           f"which only the chat template may write; remove {token!r} from that text")
    return ids


def end_of_turn_ids(tokenizer) -> list[int]:
    """The special token the chat template writes right after an assistant message (``<|im_end|>``,
    ``<|eot_id|>``, ``<end_of_turn>``...), as a stop id; [] when there is none or no template.

    The executor already stops at the generation config's EOS ids (``SpeculativeExecutor``'s ``_eos_ids``:
    ``generation_config.eos_token_id``, int or list, plus the model config's and the tokenizer's EOS), which covers
    most instruct models. A base model with a chat template often lists only ``<|endoftext|>`` there, and would run
    past the end of its turn; passing these ids as ``stop_token_ids`` makes every chat stop at its turn's end.
    """
    if not has_chat_template(tokenizer):
        return []
    import secrets

    from jinja2 import TemplateError

    marker = f"reply{secrets.token_hex(6)}"
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], tokenize=False,
            add_generation_prompt=False)
    except (TemplateError, ValueError):
        return []
    if not isinstance(rendered, str) or marker not in rendered:
        return []
    tail = rendered[rendered.rindex(marker) + len(marker):]
    special = _special_ids(tokenizer)
    ids = tokenizer.encode(tail, add_special_tokens=False) if tail else []
    return [next(t for t in ids if t in special)] if any(t in special for t in ids) else []
