"""OpenAI request bodies -> the inputs of Triton's speculative models, checked field by field.

The proxy checks what only it can: JSON types (so a value converts to its tensor without wrapping around), the
integers' ranges and the floats' finiteness and 32-bit range for the same reason, the OpenAI fields this server
cannot honour, and the prompt's shape. A request that names no max_tokens asks the model to fit the default into
its KV pool (``max_tokens_fit``) instead of refusing a prompt that leaves less room. The
remaining value rules (temperature >= 0, top_p in (0, 1], K within the engine's limit, a prompt within
max_input_len, message roles, the chat template) stay in one place, the model's own checks
(pipeline/triton/request_inputs.py), whose one-line errors pass through as 400s.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from ..errors import short_repr
from .errors import ApiError, bad_request

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# A chat without max_tokens runs until its turn ends, but never past this: a model that never writes its
# end-of-turn token would otherwise hold a batch slot for the whole context.
CHAT_MAX_TOKENS_CAP = 1024
OPENAI_TEMPERATURE = 1.0  # OpenAI's default: sampling (the Triton models' own default is greedy)
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 1024  # each is matched against the text's tail once per engine step
INT32_MAX = 2**31 - 1
FP32_MAX = 3.4028234663852886e38  # the largest finite float32: past it a value would reach the model as inf
UINT64_LIMIT = 2**64

# Bookkeeping fields that do not change the output: accepted and ignored.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                     "safety_identifier"})
# The output controls: numbers and flags forwarded as the Triton inputs of the same name (the model checks ranges).
CONTROL_NUMBERS = ("presence_penalty", "frequency_penalty", "repetition_penalty")
COMMON = frozenset({"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop",
                    "top_k", "num_draft_tokens", "cache_salt", "speculative_method", "n", "logprobs", "logit_bias",
                    "min_tokens", "ignore_eos", "response_format", *CONTROL_NUMBERS})
MAX_CHOICES = 16  # n: each choice is a request of its own in the engine's batch
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions' logprobs
MAX_TOP_LOGPROBS = 20  # and for chat's top_logprobs
# Fields that change the output and that this server cannot honour: accepted only at their neutral values.
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "best_of": ((1,), "one candidate per choice is supported; use n for several choices"),
    "echo": ((False,), "the prompt is not echoed back; prepend it yourself"),
    "suffix": (("",), "insertion (text after the completion) is not supported; leave it out"),
    "functions": (([],), "the deprecated functions field is not supported; send tools"),
    "function_call": (("none",), "the deprecated function_call field is not supported; send tool_choice"),
    "modalities": ((["text"],), "text output only; leave it out"),
    "audio": ((), "text output only; leave it out"),
    "prediction": ((), "predicted outputs are not supported; leave it out"),
}
COMPLETION_FIELDS = COMMON | {"prompt", "best_of", "echo", "suffix"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"} | \
    (UNSUPPORTED.keys() - {"best_of", "echo", "suffix"})
# Message keys a client may echo back from a response; ignored while empty (the template never sees them).
ECHOED_MESSAGE_KEYS = frozenset({"refusal", "annotations", "audio", "function_call"})
TOOL_MESSAGE_KEYS = ("tool_calls", "tool_call_id")  # an agent loop's calls and results: checked by the model


@dataclass(frozen=True)
class ServedModel:
    """The one model behind the endpoint: its name (the config's) and the target engine's limits."""

    name: str
    max_seq_len: int
    max_input_len: int
    max_prompt_bytes: int  # the model refuses a longer text prompt before tokenizing it
    tool_format: str | None = None  # how the chat template writes tool calls (pipeline.tool_calls); None: no tools

    @property
    def chat_max_tokens(self) -> int:
        """A chat's default max_tokens: room every accepted prompt leaves (the proxy cannot count a chat's
        tokens; the template is applied inside the model), capped; sent with max_tokens_fit, so the model lowers
        it to what its KV pool holds for the prompt."""
        return max(1, min(CHAT_MAX_TOKENS_CAP, self.max_seq_len - self.max_input_len))

    @property
    def max_body_bytes(self) -> int:
        # JSON escapes at most triple a prompt's UTF-8 size (\uXXXX); the rest is room for the other fields.
        return 4 * self.max_prompt_bytes + 65536


@dataclass(frozen=True)
class GenerationRequest:
    """One checked OpenAI request: the Triton inputs and what the proxy itself does (stop strings, streaming)."""

    chat: bool
    inputs: dict[str, object]  # Triton input name -> value: str, list[int], int, float or bool
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices: n engine requests, the i-th seeded seed + i when a seed is given
    logprobs: bool = False  # the response carries each token's log-probability (Triton's logprobs input is set)
    tool_format: str | None = None  # parse the answer's tool calls in this format (None: plain content)

    def choice_inputs(self, index: int) -> dict[str, object]:
        """The Triton inputs of choice ``index``: its own seed, so a seed reproduces all n and they differ."""
        if index == 0 or "seed" not in self.inputs:
            return self.inputs
        return {**self.inputs, "seed": (int(self.inputs["seed"]) + index) % UINT64_LIMIT}


def parse_completion(body: object, served: ServedModel) -> GenerationRequest:
    body = _check_fields(body, COMPLETION_FIELDS, served)
    if "prompt" not in body:
        raise bad_request("prompt", "required; send the prompt text (or a list of token ids)")
    name, prompt = _prompt(body["prompt"])
    max_tokens = _max_tokens(body, ("max_tokens",), COMPLETION_MAX_TOKENS)
    logprobs = _integer(body, "logprobs", f"must be an integer in [0, {MAX_COMPLETION_LOGPROBS}] (the likeliest "
                                          f"tokens returned beside each token)", MAX_COMPLETION_LOGPROBS)
    return _request(body, chat=False, prompt={name: prompt}, max_tokens=max_tokens, logprobs=logprobs)


def parse_chat(body: object, served: ServedModel) -> GenerationRequest:
    body = _check_fields(body, CHAT_FIELDS, served)
    if "messages" not in body:
        raise bad_request("messages", 'required; send [{"role": "user", "content": "..."}]')
    messages = _messages(body["messages"])
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), served.chat_max_tokens)
    prompt = {"messages": json.dumps(messages, ensure_ascii=False), **_tools(body, served)}
    request = _request(body, chat=True, prompt=prompt, max_tokens=max_tokens, logprobs=_chat_logprobs(body))
    if "tools" in prompt and body.get("tool_choice") != "none":
        request = dataclasses.replace(request, tool_format=served.tool_format)
    return request


def _chat_logprobs(body: dict) -> int | None:
    """Chat's logprobs (true/false) and top_logprobs (0-20) -> the alternatives per token, or None for none."""
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise bad_request("logprobs", f"{short_repr(wanted, 40)} must be true or false (top_logprobs sets how many "
                                      f"alternatives)")
    top = _integer(body, "top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]", MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise bad_request("top_logprobs", "only with logprobs: true; set logprobs too")
    return (top or 0) if wanted else None


def _tools(body: dict, served: ServedModel) -> dict[str, str]:
    """tools and tool_choice as the model's JSON inputs; refused at once when the template has no tool format."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice", f"{short_repr(choice, 60)} needs tools; send tools too")
        return {}
    if served.tool_format is None:
        raise bad_request("tools", f"the chat template of {served.name} does not render tools, so it has no "
                                   f"tool-call format; leave tools out, or serve a model whose template has one",
                          code="unsupported_parameter")
    inputs = {"tools": json.dumps(tools, ensure_ascii=False)}
    if choice is not None:
        inputs["tool_choice"] = json.dumps(choice, ensure_ascii=False)
    return inputs


# ---- the parts ------------------------------------------------------------------------------------------------------

def _check_fields(body: object, allowed: frozenset[str], served: ServedModel) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, f"request body: expected a JSON object, got {type(body).__name__}")
    for name, value in body.items():
        if name in IGNORED:
            continue
        if name not in allowed:
            raise bad_request(name, "unknown parameter; remove it (the extensions this server adds are top_k, "
                                    "num_draft_tokens, cache_salt and speculative_method)",
                              code="unknown_parameter")
        if name in UNSUPPORTED and not _neutral(value, UNSUPPORTED[name][0]):
            raise bad_request(name, f"{short_repr(value, 40)} is not supported: {UNSUPPORTED[name][1]}",
                              code="unsupported_parameter")
    model = body.get("model")
    if model is not None and model != served.name:
        raise ApiError(404, f"model: {short_repr(model, 60)} is not served here; this endpoint serves "
                            f"{served.name!r} (GET /v1/models)", param="model", code="model_not_found")
    return body


def _neutral(value: object, neutral: tuple) -> bool:
    """None, or one of the neutral values (True is not 1 here, nor False 0)."""
    return value is None or any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(body: dict, name: str, rule: str, limit: int = INT32_MAX) -> int | None:
    value = body.get(name)
    if value is not None and (not _is_int(value) or not 0 <= value <= limit):
        raise bad_request(name, f"{short_repr(value, 40)} {rule}")
    return value


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(name, f"{short_repr(value, 40)} is not a number")
    # Compared before float(): an integer of hundreds of digits is valid JSON, and float() of it overflows.
    if not (abs(value) <= FP32_MAX and math.isfinite(value)):
        raise bad_request(name, f"{short_repr(value, 40)} is not a finite number within the 32-bit float range; "
                                f"send a plain number such as 0.7")
    return float(value)


def _max_tokens(body: dict, names: tuple[str, ...], default: int) -> tuple[int, bool]:
    """(max_tokens, fit): the request's own value, or the default to be fitted to the KV pool (fit True)."""
    rule = f"must be an integer >= 0 and at most {INT32_MAX} (the number of tokens to generate)"
    given = {name: _integer(body, name, rule) for name in names if body.get(name) is not None}
    if len(set(given.values())) > 1:
        raise bad_request(names[0], f"{given[names[0]]} differs from {names[1]} {given[names[1]]}; send one of them")
    return next(iter(given.values()), default), not given


def _controls(body: dict) -> dict[str, object]:
    """The output controls given, as Triton inputs: numbers checked for type and range here, the rest by the model
    (JSON values are forwarded as JSON text)."""
    inputs: dict[str, object] = {name: _number(body, name) for name in CONTROL_NUMBERS}
    inputs["min_tokens"] = _integer(body, "min_tokens", "must be an integer >= 0 (stop tokens wait until then)")
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise bad_request("ignore_eos", f"{short_repr(ignore_eos, 40)} must be true or false")
    inputs["ignore_eos"] = ignore_eos
    for name in ("logit_bias", "response_format"):
        value = body.get(name)
        if value is not None and not isinstance(value, dict):
            raise bad_request(name, f"{short_repr(value, 60)} must be a JSON object")
        if value and value != {"type": "text"}:  # free text is what a request without the field gets
            inputs[name] = json.dumps(value, ensure_ascii=False)
    return {name: value for name, value in inputs.items() if value is not None}


def _request(body: dict, chat: bool, prompt: dict, max_tokens: tuple[int, bool],
             logprobs: int | None = None) -> GenerationRequest:
    temperature = _number(body, "temperature")
    inputs: dict[str, object] = {
        **prompt, "max_tokens": max_tokens[0],
        "temperature": OPENAI_TEMPERATURE if temperature is None else temperature,
    }
    if max_tokens[1]:  # no max_tokens named: the model lowers the default to what its KV pool holds
        inputs["max_tokens_fit"] = True
    optional = {
        "top_p": _number(body, "top_p"),
        "top_k": _integer(body, "top_k", "must be an integer >= 0 (0 disables it)"),
        "seed": _integer(body, "seed", "must be an integer in [0, 2**64)", UINT64_LIMIT - 1),
        "num_draft_tokens": _integer(body, "num_draft_tokens", "must be an integer >= 0 (0 = target-only decoding)"),
    }
    inputs.update({name: value for name, value in optional.items() if value is not None})
    salt = body.get("cache_salt")
    if salt is not None:  # the model checks its length; requests share cached prefixes only within one salt
        if not isinstance(salt, str) or not salt:
            raise bad_request("cache_salt", f"{short_repr(salt, 40)} must be a non-empty string (a random token per "
                                            f"user or tenant)")
        inputs["cache_salt"] = salt
    method = body.get("speculative_method")
    if method is not None:  # the model checks it against the methods its engines can run
        if not isinstance(method, str) or not method:
            raise bad_request("speculative_method", f"{short_repr(method, 40)} must be a method's name such as "
                                                    f"\"ngram\"")
        inputs["speculative_method"] = method
    inputs.update(_controls(body))
    if logprobs is not None:
        inputs["logprobs"] = logprobs
    n = _integer(body, "n", f"must be an integer in [1, {MAX_CHOICES}] (the number of choices)", MAX_CHOICES)
    if n == 0:
        raise bad_request("n", f"0 must be an integer in [1, {MAX_CHOICES}] (the number of choices)")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("stream", f"{short_repr(stream, 40)} must be true or false")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("stream_options", "only allowed when stream is true")
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise bad_request("stream_options", f"{short_repr(options, 60)} must be an object such as "
                                                f'{{"include_usage": true}}')
        include_usage = options.get("include_usage", False)
    return GenerationRequest(chat=chat, inputs=inputs, stop=_stop(body.get("stop")), stream=bool(stream),
                             include_usage=include_usage, n=n or 1, logprobs=logprobs is not None)


def _stop(value: object) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value if value is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop", f"{short_repr(value, 60)} must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request("stop", f"{len(stops)} stop strings; send at most {MAX_STOP_STRINGS}")
    for stop in stops:
        if len(stop) > MAX_STOP_CHARS:
            raise bad_request("stop", f"a stop string of {len(stop)} characters is over the {MAX_STOP_CHARS}-"
                                      f"character limit; shorten it")
    return tuple(s for s in stops if s)


def _prompt(value: object) -> tuple[str, str | list[int]]:
    """("text_input", text) or ("input_ids", ids): one prompt, as a string, token ids, or a list of one of them."""
    if isinstance(value, str):
        return "text_input", value
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        bad = next((t for t in value if not 0 <= t <= INT32_MAX), None)
        if bad is not None:
            raise bad_request("prompt", f"token id {bad} is out of range; token ids are >= 0")
        return "input_ids", list(value)
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)) and value[0]:
        if isinstance(value[0], str) or all(_is_int(t) for t in value[0]):
            return _prompt(value[0])
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise bad_request("prompt", f"{len(value)} prompts in one request; send one prompt per request (they are "
                                    f"batched on the server anyway)")
    raise bad_request("prompt", f"{short_repr(value, 60)} must be a string or a non-empty list of token ids")


def _messages(value: object) -> list[dict]:
    """OpenAI messages -> the model's {"role", "content"} messages; roles and contents are checked by the model."""
    if not isinstance(value, list):
        raise bad_request("messages", f'expected a list of messages such as [{{"role": "user", "content": "Hi"}}], '
                                      f"got {type(value).__name__}")
    converted = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where}: {short_repr(message, 40)} is not an object with role and content",
                           param="messages")
        for key, item in message.items():
            if key in ("role", "content", "name", *TOOL_MESSAGE_KEYS):  # a name is not rendered: templates differ
                continue
            if key in ECHOED_MESSAGE_KEYS and not item:
                continue
            why = ("send tools and tool_choice instead" if key.startswith("function")
                   else "a message holds role, content, and tool_calls or tool_call_id")
            raise ApiError(400, f"{where}.{key}: not supported ({why}); remove it", param="messages")
        content = message.get("content")
        entry = {"role": message.get("role"),
                 "content": _text_parts(content, where) if isinstance(content, list) else content}
        entry.update({key: message[key] for key in TOOL_MESSAGE_KEYS if message.get(key)})
        converted.append(entry)
    return converted


def _text_parts(parts: list, where: str) -> str:
    """Content given as parts: text parts joined by newlines; any other kind is refused."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}.content[{j}]: {short_repr(kind or part, 40)} is not supported; send text "
                                f'parts ({{"type": "text", "text": "..."}}) or a string', param="messages")
        texts.append(part["text"])
    return "\n".join(texts)
