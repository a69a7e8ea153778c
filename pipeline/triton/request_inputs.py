"""Turn one Triton request's input tensors into executor arguments, rejecting bad values with a clear message.

Used by the Python model (``python_model/model.py``) inside tritonserver, and importable without Triton so the
rules can be unit-tested. Triton itself already rejects wrong dtypes and shapes against config.pbtxt; the checks
here cover values (negative max_tokens, top_p out of range, K above the engine's limit, ...) and size: a prompt
is refused by its byte length before it is decoded or tokenized (MAX_BYTES_PER_TOKEN per token of the engine's
max_input_len), so an oversized request costs microseconds instead of seconds of the only engine thread and
gigabytes of tokenizer memory; it also bounds how long any accepted prompt takes to tokenize.

The prompt is exactly one of ``text_input`` (a string), ``input_ids`` (token ids) or ``messages`` (JSON text of a
list of ``{"role", "content"}`` chat messages): the messages are parsed and checked here, and encoded through the
model's chat template by ``GenerateArgs.executor_prompt`` (pipeline.chat), where the tokenizer is at hand.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..chat import Message, chat_tool_format, encode_chat, end_of_turn_ids, validate_messages
from ..tool_calls import forced_call_format, validate_tool_choice, validate_tools
from ..executor.request_values import MAX_NEW_TOKENS, validate_controls, validate_request
from ..errors import short_repr
from ..executor.results import RequestError
from ..methods import Method

# A prompt of max_input_len tokens is at most this many UTF-8 bytes per token: real tokenizers average 2-5 bytes
# per token on text and code; 32 leaves room for long whitespace and repeated-character tokens. A longer prompt
# cannot fit the engine (or is mostly padding) and is refused before tokenizing.
MAX_BYTES_PER_TOKEN = 32
# The limit when the caller does not pass max_input_len: 32 bytes x 32768 tokens (1 MiB, about 2 s to tokenize).
FALLBACK_MAX_INPUT_LEN = 32768
MAX_CACHE_SALT_BYTES = 256
MAX_METHOD_BYTES = 32  # longer than any method's name
MAX_JSON_INPUT_BYTES = 65536  # logit_bias, response_format, tools, tool_choice: each JSON text at most this long
# The output controls' inputs -> validate_controls's names (the same, but for the JSON ones parsed first).
CONTROL_INPUTS = {"presence_penalty": "f", "frequency_penalty": "f", "repetition_penalty": "f", "min_tokens": "iu",
                  "ignore_eos": "b", "logprobs": "iu"}
JSON_INPUTS = ("logit_bias", "response_format", "tools", "tool_choice")
# Triton's input names for the request values (the executor's names are the keys).
TRITON_NAMES = {"max_new_tokens": "max_tokens", "max_draft_len": "num_draft_tokens"}

PROMPT_INPUTS = ("text_input", "input_ids", "messages")  # a request sends exactly one of them
GetInput = Callable[[str], "np.ndarray | None"]  # name -> the request's tensor, or None when absent


@dataclass(frozen=True)
class GenerateArgs:
    prompt: str | list[int] | None  # text_input or input_ids; None when the request sent messages
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_draft_len: int | None = None  # None = the engine's K
    messages: list[Message] | None = None  # the ``messages`` input, checked but not yet encoded
    fit_max_tokens: bool = False  # lower max_new_tokens to what the KV pool holds instead of refusing
    cache_salt: str | None = None  # prefix blocks are shared only between requests of the same salt
    method: str | None = None  # speculative_method: the request's drafting method (None: the engine's)
    controls: dict = field(default_factory=dict)  # output controls given (validate_controls's keywords)
    tools: list[dict] | None = None  # checked tools to render (None: none, or tool_choice "none")
    tool_choice: str | dict = "none"  # checked: "auto", "required" or a named function (with tools)

    def executor_kwargs(self, tokenizer=None) -> dict:
        """``executor.new_request``'s keywords; with ``tokenizer`` a tool_choice that requires a call becomes the
        response_format of one call in the chat template's tool format (where it writes calls as text)."""
        controls = dict(self.controls)
        if self.tools is not None and tokenizer is not None and self.tool_choice not in ("auto", "none"):
            fmt = chat_tool_format(tokenizer)
            forced = forced_call_format(self.tools, self.tool_choice, fmt)
            if forced is None:
                raise RequestError(f"tool_choice: {short_repr(self.tool_choice, 60)} cannot be enforced in this "
                                   f"model's tool format ({fmt}: a call opens with a special token); send \"auto\"")
            controls["response_format"] = forced
        return dict(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                    top_p=self.top_p, seed=self.seed, max_draft_len=self.max_draft_len,
                    fit_max_tokens=self.fit_max_tokens, cache_salt=self.cache_salt, method=self.method, **controls)

    def executor_prompt(self, tokenizer, source: str | None = None) -> tuple[str | list[int], list[int]]:
        """(prompt, extra stop ids) for ``executor.new_request``: a chat is encoded through the tokenizer's chat
        template (message text as plain text, tools rendered by it) and stops at the end of the assistant's turn;
        raises RequestError when the model has no chat template, or no tool format for tools."""
        if self.messages is None:
            return self.prompt, []
        if self.tools is not None and chat_tool_format(tokenizer) is None:
            raise RequestError(f"tools: the chat template of {source or 'this model'} does not render tools, so "
                               f"this model has no tool-call format; leave tools out, or serve a model whose "
                               f"template has one (Qwen, Llama 3.1, Mistral, Hermes)")
        return (encode_chat(tokenizer, self.messages, source=source, tools=self.tools),
                end_of_turn_ids(tokenizer))


def _one(get: GetInput, name: str, kind: str, required: bool = False):
    """The single value of a [batch=1, 1] tensor, or None when the optional input is absent."""
    value = get(name)
    if value is None:
        if required:
            raise RequestError(f"{name}: required input missing; send it as a [1, 1] tensor")
        return None
    value = np.asarray(value)
    if value.size != 1:
        raise RequestError(f"{name}: expected one value per request, got shape {list(value.shape)}; Triton "
                           f"batches concurrent requests itself, send one prompt per request")
    if value.dtype.kind not in kind:
        raise RequestError(f"{name}: dtype {value.dtype} is not accepted; see the model's config.pbtxt")
    return value.reshape(-1)[0].item()


def max_prompt_bytes(max_input_len: int) -> int:
    """The largest text_input (UTF-8 bytes) accepted for an engine built with ``max_input_len``."""
    return MAX_BYTES_PER_TOKEN * max_input_len


def _string(value, name: str, max_input_len: int | None) -> str:
    """The one string of a BYTES input, refused by its size before it is decoded (see the module docstring)."""
    text = np.asarray(value)
    if text.size != 1:
        raise RequestError(f"{name}: expected one string per request, got shape {list(text.shape)}")
    raw = text.reshape(-1)[0]
    limit = max_prompt_bytes(max_input_len or FALLBACK_MAX_INPUT_LEN)
    why = f"{MAX_BYTES_PER_TOKEN} bytes per token of max_input_len {max_input_len}, " if max_input_len else ""
    if isinstance(raw, bytes):  # what Triton hands over
        size = len(raw)
    else:  # a str (tests, other callers): characters bound the bytes from below; encode only short ones
        raw = str(raw)
        size = len(raw) if len(raw) > limit else len(raw.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise RequestError(f"{name}: {size} bytes is over the {limit}-byte limit ({why}refused before "
                           f"tokenizing); shorten the prompt")
    try:
        return raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
    except UnicodeDecodeError as exc:
        raise RequestError(f"{name}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def _messages(value, max_input_len: int | None) -> list[Message]:
    """``messages``: JSON text of a list of {"role", "content"} messages, checked by pipeline.chat."""
    text = _string(value, "messages", max_input_len)
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: thousands of nested brackets
        raise RequestError(f"messages: not valid JSON ({str(exc)[:120]}); send JSON text such as "
                           f'[{{"role": "user", "content": "Hello"}}]') from None
    return validate_messages(parsed, "messages")


def _prompt(get: GetInput, max_input_len: int | None) -> tuple[str | list[int] | None, list[Message] | None]:
    """(text or token ids, None), or (None, messages)."""
    given = {name: get(name) for name in PROMPT_INPUTS}
    given = {name: value for name, value in given.items() if value is not None}
    if len(given) != 1:
        raise RequestError("text_input / input_ids / messages: send exactly one of them (a string, token ids, or "
                           "a JSON list of chat messages)")
    ((name, value),) = given.items()
    if name == "text_input":
        return _string(value, "text_input", max_input_len), None
    if name == "messages":
        return None, _messages(value, max_input_len)
    ids = np.asarray(value)
    if ids.ndim > 1 and ids.shape[0] != 1:
        raise RequestError(f"input_ids: expected one sequence per request, got shape {list(ids.shape)}")
    if ids.dtype.kind not in "iu":
        raise RequestError(f"input_ids: dtype {ids.dtype} is not an integer type; send INT32 token ids")
    if ids.size > (max_input_len or FALLBACK_MAX_INPUT_LEN):  # before building a list of millions of ints
        raise RequestError(f"input_ids: {ids.size} tokens exceeds max_input_len "
                           f"{max_input_len or FALLBACK_MAX_INPUT_LEN}; shorten it")
    return [int(t) for t in ids.reshape(-1)], None


def parse_request(get: GetInput, engine_draft_len: int, max_input_len: int | None = None) -> GenerateArgs:
    """Validate one request; raises RequestError naming the input, the bad value and the fix.

    ``engine_draft_len`` bounds num_draft_tokens (the request's max_draft_len); ``max_input_len`` (the engine's, in
    tokens) bounds the prompt before it is decoded or tokenized; without it
    the bound is FALLBACK_MAX_INPUT_LEN.
    """
    prompt, messages = _prompt(get, max_input_len)  # messages are encoded later, with the model's tokenizer
    max_tokens = _one(get, "max_tokens", "iu", required=True)
    temperature = _one(get, "temperature", "f")
    temperature = 0.0 if temperature is None else float(temperature)
    top_k = _one(get, "top_k", "iu")
    top_k = 0 if top_k is None else int(top_k)
    top_p = _one(get, "top_p", "f")
    top_p = 1.0 if top_p is None else float(top_p)
    seed = _one(get, "seed", "iu")
    k = _one(get, "num_draft_tokens", "iu")
    try:
        validate_request(max_tokens, temperature, top_k, top_p, seed, k, engine_draft_len=engine_draft_len,
                         names=TRITON_NAMES)
    except RequestError as exc:
        if max_tokens < -1:  # Triton's JSON parser keeps only the low 32 bits of a number above INT32's range
            raise RequestError(f"{exc}; a JSON value above {MAX_NEW_TOKENS} arrives wrapped around") from None
        raise
    fit = _one(get, "max_tokens_fit", "b")
    controls, tools, choice = _controls(get, messages is not None)
    return GenerateArgs(prompt, int(max_tokens), temperature, top_k, top_p,
                        None if seed is None else int(seed), None if k is None else int(k), messages,
                        fit_max_tokens=bool(fit), cache_salt=_cache_salt(get), method=_method(get),
                        controls=controls, tools=tools, tool_choice=choice)


def _json_input(get: GetInput, name: str):
    """A JSON-text input parsed (None when absent); refused past MAX_JSON_INPUT_BYTES before it is parsed."""
    text = _short_string(get, name, MAX_JSON_INPUT_BYTES, f"JSON text of at most {MAX_JSON_INPUT_BYTES} bytes")
    if text is None:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise RequestError(f"{name}: not valid JSON ({str(exc)[:120]})") from None


def _controls(get: GetInput, chat: bool) -> tuple[dict, list[dict] | None, str | dict]:
    """(the output controls given, as validate_controls's keywords, checked; the tools to render or None; the
    checked tool_choice)."""
    given = {name: _one(get, name, kind) for name, kind in CONTROL_INPUTS.items()}
    given = {name: value for name, value in given.items() if value is not None}
    if "logprobs" in given and given["logprobs"] < 0:  # a negative count means "none", as an absent input
        del given["logprobs"]
    parsed = {name: _json_input(get, name) for name in JSON_INPUTS}
    given.update({name: parsed[name] for name in ("logit_bias", "response_format") if parsed[name] is not None})
    validate_controls(**given)  # early, naming the input; the executor checks again with its vocabulary
    if parsed["tools"] is None:
        if parsed["tool_choice"] not in (None, "none", "auto"):
            raise RequestError("tool_choice: names a tool, but the request sends no tools; send tools too")
        return given, None, "none"
    if not chat:
        raise RequestError("tools: only for chats (send messages); a text prompt has no template to render them")
    tools = validate_tools(parsed["tools"])
    choice = validate_tool_choice("auto" if parsed["tool_choice"] is None else parsed["tool_choice"], tools)
    if choice not in ("auto", "none") and "response_format" in given:
        raise RequestError("tool_choice: a required call is its own format; send it or response_format, not both")
    return given, None if choice == "none" else tools, choice


def _method(get: GetInput) -> str | None:
    """speculative_method, one of the methods' names (which of them the engines can run, the executor checks when it
    takes the request); a value longer than any name is refused before it is decoded."""
    names = ", ".join(m.value for m in Method)
    method = _short_string(get, "speculative_method", MAX_METHOD_BYTES,
                           f"a method's name ({names}), or leave it out for the served default")
    if method is not None and method not in {m.value for m in Method}:
        raise RequestError(f"speculative_method: {short_repr(method, 40)} is unknown; use one of {names}, or leave "
                           f"it out for the served default")
    return method


def _cache_salt(get: GetInput) -> str | None:
    return _short_string(get, "cache_salt", MAX_CACHE_SALT_BYTES,
                         f"1 to {MAX_CACHE_SALT_BYTES} bytes (a random token per user or tenant), or leave it out")


def _short_string(get: GetInput, name: str, limit: int, fix: str) -> str | None:
    """One string input of 1..``limit`` bytes as text, None when absent; RequestError naming ``name`` and ``fix``."""
    value = get(name)
    if value is None:
        return None
    raw = np.asarray(value)
    if raw.size != 1:
        raise RequestError(f"{name}: expected one string per request, got shape {list(raw.shape)}")
    item = raw.reshape(-1)[0]
    item = item if isinstance(item, bytes) else str(item).encode("utf-8", "surrogatepass")
    if not 0 < len(item) <= limit:
        raise RequestError(f"{name}: {len(item)} bytes; send {fix}")
    return item.decode("utf-8", "replace")
