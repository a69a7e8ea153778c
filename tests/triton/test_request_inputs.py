"""Property tests for the served model's request parsing (pipeline/triton/request_inputs.py).

Whatever tensors a request carries (any subset of the input names plus unknown ones, any dtype, any shape,
NaN / inf / extreme integers / empty arrays / bytes that are not UTF-8), ``parse_request`` either returns a
GenerateArgs the executor can take, or raises RequestError: the one exception the Python model turns into an
INVALID_ARG response naming the input. Any other exception would reach the client as "internal error".
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from pipeline.chat import ROLES
from pipeline.executor import RequestError
from pipeline.triton.request_inputs import FALLBACK_MAX_INPUT_LEN, GenerateArgs, MAX_BYTES_PER_TOKEN, parse_request
from pipeline.serving_contract import INPUTS

NAMES = [name for name, _, _ in INPUTS]  # text_input, input_ids, messages, max_tokens, temperature, top_k, ...
PROMPTS = ["text_input", "input_ids", "messages"]
K_LIMIT = 4

NUMERIC_DTYPES = [np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
                                         np.uint64, np.float16, np.float32, np.float64, np.bool_, np.complex64)]
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3)


def _bytes_array(shape):
    # What Triton hands the model for a BYTES tensor: an object array of bytes (any bytes, UTF-8 or not).
    return hnp.arrays(np.object_, shape, elements=st.binary(max_size=12), fill=st.nothing())


def any_array():
    numeric = st.sampled_from(NUMERIC_DTYPES).flatmap(lambda dtype: hnp.arrays(dtype, SHAPES))
    strings = st.one_of(hnp.arrays(hnp.byte_string_dtypes(max_len=4), SHAPES),
                        hnp.arrays(hnp.unicode_string_dtypes(max_len=4), SHAPES))
    return st.one_of(numeric, strings, SHAPES.flatmap(_bytes_array))


def _int_values(dtype):
    info = np.iinfo(dtype)
    return st.one_of(st.integers(-2, 10).filter(lambda v: info.min <= v <= info.max),
                     st.integers(int(info.min), int(info.max)))


def _json_messages():
    """JSON text of message lists, mostly well formed, with wrong roles, types, keys and shapes mixed in."""
    text = st.text(max_size=12)
    role = st.one_of(st.sampled_from(ROLES), text, st.integers(), st.none())
    content = st.one_of(text, text, st.integers(), st.lists(text, max_size=2), st.none())
    message = st.one_of(st.fixed_dictionaries({"role": role, "content": content}),
                        st.fixed_dictionaries({"role": role, "content": content, "name": text}),
                        st.dictionaries(text, text, max_size=2), text, st.integers())
    value = st.one_of(st.lists(message, max_size=3), message, st.none(), st.floats())
    return st.one_of(value.map(lambda v: json.dumps(v).encode()), st.binary(max_size=12))


def plausible_array(name: str):
    """Per-input values of the declared dtype and [1, 1] shape, mostly in range so the valid path is reached
    often, with out-of-range, NaN, inf and extreme values mixed in."""
    if name == "text_input":
        return _bytes_array((1, 1))
    if name == "messages":
        return _json_messages().map(lambda raw: np.array([[raw]], dtype=np.object_))
    if name == "input_ids":
        return st.integers(0, 6).flatmap(lambda n: hnp.arrays(np.int32, (1, n), elements=_int_values(np.int32)))
    if name in ("temperature", "top_p"):
        values = st.one_of(st.floats(0, 1, width=32), st.floats(width=32, allow_nan=True, allow_infinity=True))
        return hnp.arrays(np.float32, (1, 1), elements=values)
    dtype = np.uint64 if name == "seed" else np.int32  # max_tokens, top_k, num_draft_tokens: INT32
    return hnp.arrays(dtype, (1, 1), elements=_int_values(dtype))


@st.composite
def requests(draw, plausible: bool) -> dict[str, np.ndarray]:
    if plausible:  # one prompt input and max_tokens most of the time, the optional inputs at random
        prompt = draw(st.sampled_from([["text_input"]] * 3 + [["input_ids"]] * 3 + [["messages"]] * 3
                                      + [[], PROMPTS[:2], PROMPTS[::2]]))
        names = prompt + [name for name in NAMES if name not in PROMPTS
                          and (draw(st.booleans()) or name == "max_tokens")]
        names = draw(st.permutations(names))  # also some without max_tokens
        names = names[:len(names) - draw(st.sampled_from([0] * 7 + [1]))]
        return {name: draw(plausible_array(name)) for name in names}
    names = draw(st.lists(st.sampled_from(NAMES + ["unknown_input"]), unique=True, max_size=len(NAMES) + 1))
    return {name: draw(any_array()) for name in names}


def check(request: dict[str, np.ndarray]) -> GenerateArgs | None:
    try:
        args = parse_request(request.get, K_LIMIT)
    except RequestError as exc:
        # A clear error names the input it is about (or the text_input / input_ids / messages trio) first.
        assert str(exc).split(":")[0].split(" /")[0] in NAMES, str(exc)
        return None
    # Anything accepted is within the documented ranges and of plain Python types the executor takes.
    if args.messages is not None:  # a chat: checked messages, encoded later with the model's tokenizer
        assert args.prompt is None and args.messages
        assert all(set(m) == {"role", "content"} and m["role"] in ROLES and type(m["content"]) is str
                   for m in args.messages)
    else:
        assert isinstance(args.prompt, str) or all(type(t) is int for t in args.prompt)
    assert type(args.max_new_tokens) is int and 0 <= args.max_new_tokens <= 2**31 - 1
    assert type(args.temperature) is float and math.isfinite(args.temperature) and args.temperature >= 0
    assert type(args.top_k) is int and args.top_k >= 0
    assert type(args.top_p) is float and 0 < args.top_p <= 1
    assert args.seed is None or type(args.seed) is int
    assert args.max_draft_len is None or (type(args.max_draft_len) is int and 0 <= args.max_draft_len <= K_LIMIT)
    return args


SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(requests(plausible=False))
def test_any_tensors_parse_or_raise_request_error(request):
    check(request)


@SETTINGS
@given(requests(plausible=True))
def test_declared_dtypes_with_any_values_parse_or_raise_request_error(request):
    check(request)


@SETTINGS
@given(st.sampled_from(NAMES), st.data())
def test_one_input_varied_in_a_valid_request(name, data):
    # A valid request with one input replaced: reaches each input's own value checks (NaN, inf, extremes).
    request = {"text_input": np.array([[b"def f(x):"]], dtype=np.object_), "max_tokens": np.array([[8]], np.int32)}
    if name == "input_ids":
        del request["text_input"]
    request[name] = data.draw(st.one_of(plausible_array(name), any_array()))
    check(request)


@given(st.binary(max_size=16))
def test_text_input_bytes_decode_or_name_utf8(raw):
    request = {"text_input": np.array([[raw]], dtype=np.object_), "max_tokens": np.array([[4]], dtype=np.int32)}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        try:
            parse_request(request.get, K_LIMIT)
        except RequestError as exc:
            assert "not valid UTF-8" in str(exc)
        else:
            raise AssertionError(f"{raw!r} is not UTF-8 but was accepted")
    else:
        assert parse_request(request.get, K_LIMIT).prompt == text


def test_valid_request_round_trips():
    request = {"input_ids": np.array([[5, 6, 7]], dtype=np.int32), "max_tokens": np.array([[8]], dtype=np.int32),
               "temperature": np.array([[0.5]], dtype=np.float32), "top_k": np.array([[3]], dtype=np.int32),
               "top_p": np.array([[0.25]], dtype=np.float32), "seed": np.array([[2**64 - 1]], dtype=np.uint64),
               "num_draft_tokens": np.array([[0]], dtype=np.int32)}
    args = check(request)
    assert args == GenerateArgs([5, 6, 7], 8, 0.5, 3, 0.25, 2**64 - 1, 0)


# ---- size and range limits (issue 12, items b and m) -------------------------------------------------------------

def _text_request(text: bytes) -> dict[str, np.ndarray]:
    return {"text_input": np.array([[text]], dtype=np.object_), "max_tokens": np.array([[4]], dtype=np.int32)}


def test_oversized_text_input_is_refused_by_its_bytes_before_decoding():
    import time

    limit = MAX_BYTES_PER_TOKEN * 512
    at_limit = b"a" * limit
    assert parse_request(_text_request(at_limit).get, K_LIMIT, max_input_len=512).prompt == at_limit.decode()
    huge = b"\xff" * (10 * 2**20)  # 10 MB, not even UTF-8: the size is checked first, nothing is decoded
    start = time.perf_counter()
    try:
        parse_request(_text_request(huge).get, K_LIMIT, max_input_len=512)
    except RequestError as exc:
        message = str(exc)
    else:
        raise AssertionError("a 10 MB text_input was accepted")
    assert time.perf_counter() - start < 0.05
    assert message.startswith(f"text_input: {len(huge)} bytes is over the {limit}-byte limit"), message
    assert f"{MAX_BYTES_PER_TOKEN} bytes per token of max_input_len 512" in message, message
    over = _text_request(b"a" * (limit + 1))
    try:
        parse_request(over.get, K_LIMIT, max_input_len=512)
    except RequestError as exc:
        assert f"{limit + 1} bytes" in str(exc)
    else:
        raise AssertionError("one byte over the limit was accepted")


def test_without_an_engine_limit_the_fallback_still_bounds_the_prompt():
    fallback = MAX_BYTES_PER_TOKEN * FALLBACK_MAX_INPUT_LEN
    assert parse_request(_text_request(b"a" * fallback).get, K_LIMIT).prompt
    try:
        parse_request(_text_request(b"a" * (fallback + 1)).get, K_LIMIT)
    except RequestError as exc:
        assert f"{fallback}-byte limit" in str(exc)
    else:
        raise AssertionError("the fallback limit was not applied")


def test_input_ids_longer_than_max_input_len_are_refused_before_conversion():
    request = {"input_ids": np.zeros((1, 5_000_000), np.int32), "max_tokens": np.array([[4]], np.int32)}
    try:
        parse_request(request.get, K_LIMIT, max_input_len=512)
    except RequestError as exc:
        assert "input_ids: 5000000 tokens exceeds max_input_len 512" in str(exc)
    else:
        raise AssertionError("5M input ids were accepted")


def test_max_tokens_beyond_int32_is_refused_not_wrapped():
    def message(value, dtype):
        request = {"text_input": np.array([[b"x"]], np.object_), "max_tokens": np.array([[value]], dtype)}
        try:
            parse_request(request.get, K_LIMIT)
        except RequestError as exc:
            return str(exc)
        raise AssertionError(f"max_tokens {value} accepted")

    assert message(2**31, np.int64).startswith("max_tokens: 2147483648 must be an integer >= 0 and at most 2147483647")
    assert message(2**64 - 1, np.uint64).startswith(f"max_tokens: {2**64 - 1} must be an integer >= 0 and at most")
    # 2147483648 in JSON reaches an INT32 model as -2147483648 (Triton cuts the high bits): say so
    wrapped = message(np.int32(-2**31), np.int32)
    assert "wrapped around" in wrapped and "at most 2147483647" in wrapped, wrapped


# ---- the messages input (issue 18) ----------------------------------------------------------------------------------

def _messages_request(raw: bytes, **extra) -> dict[str, np.ndarray]:
    return {"messages": np.array([[raw]], dtype=np.object_), "max_tokens": np.array([[4]], dtype=np.int32), **extra}


def test_messages_input_is_parsed_and_checked_not_yet_encoded():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|>"}]
    args = check(_messages_request(json.dumps(chat).encode()))
    assert args.prompt is None and args.messages == chat


@given(_json_messages())
def test_messages_parse_or_name_the_input(raw):
    check(_messages_request(raw))


def _error(request) -> str:
    try:
        parse_request(request.get, K_LIMIT, max_input_len=64)
    except RequestError as exc:
        return str(exc)
    raise AssertionError("accepted")


def test_messages_errors_name_the_input_and_the_fix():
    assert _error(_messages_request(b"[{'role': 'user'}]")).startswith("messages: not valid JSON")
    assert _error(_messages_request(b"[" * 100_000 + b"]" * 100_000)).startswith("messages: ")  # bytes limit first
    assert _error(_messages_request(b'[{"role": "user", "content": 1}]')) == (
        "messages: message 0 content is int 1; it must be a string (the message text)")
    both = _messages_request(b"[]", text_input=np.array([[b"x"]], dtype=np.object_))
    assert _error(both).startswith("text_input / input_ids / messages: send exactly one of them")
    deep = b"[" * 50 + b"]" * 50  # nested past nothing we accept, under the byte limit
    assert _error(_messages_request(deep)).startswith("messages: message 0 is list")


def test_executor_prompt_encodes_the_chat_and_stops_at_the_turn_end(real_model_dir, tiny_pair):
    from transformers import AutoTokenizer

    from pipeline.chat import encode_chat

    chat = [{"role": "user", "content": "Hi"}]
    args = check(_messages_request(json.dumps(chat).encode()))
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    assert args.executor_prompt(tokenizer) == (encode_chat(tokenizer, chat), [2])  # <|im_end|>
    text = check({"text_input": np.array([[b"Hi"]], np.object_), "max_tokens": np.array([[4]], np.int32)})
    assert text.executor_prompt(tokenizer) == ("Hi", [])
    try:
        args.executor_prompt(AutoTokenizer.from_pretrained(tiny_pair / "target"), "the served model (tiny)")
    except RequestError as exc:
        assert str(exc).startswith("messages: the tokenizer in the served model (tiny) has no chat template")
    else:
        raise AssertionError("a chat was encoded without a chat template")


def _get(**tensors):
    values = {k: np.asarray(v) for k, v in tensors.items()}
    return values.get


def test_parse_request_defaults_and_values():
    args = parse_request(_get(text_input=[[b"hello"]], max_tokens=np.array([[8]], np.int32)), 4)
    assert args.prompt == "hello" and args.max_new_tokens == 8
    assert (args.temperature, args.top_k, args.top_p, args.seed, args.max_draft_len) == (0.0, 0, 1.0, None, None)
    args = parse_request(_get(input_ids=np.array([[1, 2, 3]], np.int32), max_tokens=np.array([[2]], np.int32),
                              temperature=np.array([[0.7]], np.float32), seed=np.array([[2**63]], np.uint64),
                              num_draft_tokens=np.array([[0]], np.int32)), 4)
    assert args.prompt == [1, 2, 3] and args.seed == 2**63 and args.max_draft_len == 0
    assert args.temperature == pytest.approx(0.7)


@pytest.mark.parametrize("tensors, field", [
    (dict(text_input=[[b"x"]], max_tokens=np.array([[-1]], np.int32)), "max_tokens: -1"),
    (dict(text_input=[[b"x"]]), "max_tokens: required"),
    (dict(max_tokens=np.array([[1]], np.int32)), "text_input / input_ids"),
    (dict(text_input=[[b"x"]], input_ids=[[1]], max_tokens=np.array([[1]], np.int32)), "text_input / input_ids"),
    (dict(text_input=[[b"x"]], max_tokens=np.array([[1]], np.int32), top_p=np.array([[0.0]], np.float32)),
     "top_p: 0.0"),
    (dict(text_input=[[b"x"]], max_tokens=np.array([[1]], np.int32), temperature=np.array([[-1.0]], np.float32)),
     "temperature: -1.0"),
    (dict(text_input=[[b"x"]], max_tokens=np.array([[1]], np.int32), top_k=np.array([[-2]], np.int32)),
     "top_k: -2"),
    (dict(text_input=[[b"x"]], max_tokens=np.array([[1]], np.int32), num_draft_tokens=np.array([[9]], np.int32)),
     "num_draft_tokens: 9 is larger than the 4 the target engine was built for"),
    (dict(text_input=[[b"a"], [b"b"]], max_tokens=np.array([[1]], np.int32)), "text_input: expected one string"),
    (dict(text_input=[[b"x"]], max_tokens=np.array([[1.5]], np.float32)), "max_tokens: dtype float32"),
    (dict(text_input=[[b"\xff"]], max_tokens=np.array([[1]], np.int32)), "text_input: not valid UTF-8"),
])
def test_parse_request_rejects_bad_values(tensors, field):
    with pytest.raises(RequestError, match=field):
        parse_request(_get(**tensors), 4)


def test_max_tokens_fit_and_cache_salt_reach_the_executor():
    def request(**extra):
        values = {"text_input": np.array([[b"hello"]], dtype=np.object_), "max_tokens": np.array([[64]], np.int32),
                  **extra}
        return parse_request(values.get, K_LIMIT, 64)

    plain = request().executor_kwargs()
    assert plain["fit_max_tokens"] is False and plain["cache_salt"] is None
    fitted = request(max_tokens_fit=np.array([[True]]), cache_salt=np.array([[b"tenant-7"]], dtype=np.object_))
    assert fitted.executor_kwargs()["fit_max_tokens"] is True
    assert fitted.executor_kwargs()["cache_salt"] == "tenant-7"
    with pytest.raises(RequestError, match="cache_salt: 0 bytes"):
        request(cache_salt=np.array([[b""]], dtype=np.object_))
    with pytest.raises(RequestError, match="cache_salt: 257 bytes"):
        request(cache_salt=np.array([[b"x" * 257]], dtype=np.object_))
    with pytest.raises(RequestError, match="max_tokens_fit: dtype"):
        request(max_tokens_fit=np.array([[1.0]], np.float32))


def test_speculative_method_reaches_the_executor():
    """speculative_method names the request's drafting method; the executor checks it against what its engines can
    run, so here only its size and shape are refused."""
    def request(**extra):
        values = {"text_input": np.array([[b"hello"]], dtype=np.object_), "max_tokens": np.array([[8]], np.int32),
                  **extra}
        return parse_request(values.get, K_LIMIT, 64)

    assert request().executor_kwargs()["method"] is None
    named = request(speculative_method=np.array([[b"suffix"]], dtype=np.object_))
    assert named.executor_kwargs()["method"] == "suffix"
    with pytest.raises(RequestError, match="speculative_method: 33 bytes; send a method's name"):
        request(speculative_method=np.array([[b"x" * 33]], dtype=np.object_))
    with pytest.raises(RequestError, match="speculative_method: 'fastest' is unknown; use one of draft_model, ngram"):
        request(speculative_method=np.array([[b"fastest"]], dtype=np.object_))
    with pytest.raises(RequestError, match="speculative_method: expected one string"):
        request(speculative_method=np.array([[b"ngram", b"suffix"]], dtype=np.object_))


def test_output_controls_and_tools_reach_the_executor():
    def text(value: str):
        return np.array([[value.encode()]], dtype=np.object_)

    def request(chat: bool = False, **extra):
        prompt = {"messages": text('[{"role": "user", "content": "hi"}]')} if chat else {"text_input": text("hi")}
        return parse_request({**prompt, "max_tokens": np.array([[8]], np.int32), **extra}.get, K_LIMIT, 64)

    args = request(presence_penalty=np.array([[0.5]], np.float32), frequency_penalty=np.array([[-1.0]], np.float32),
                   repetition_penalty=np.array([[1.25]], np.float32), min_tokens=np.array([[3]], np.int32),
                   ignore_eos=np.array([[True]]), logprobs=np.array([[2]], np.int32),
                   logit_bias=text('{"7": -100}'), response_format=text('{"type": "json_object"}'))
    kwargs = args.executor_kwargs()
    assert (kwargs["presence_penalty"], kwargs["frequency_penalty"], kwargs["repetition_penalty"]) == (0.5, -1.0, 1.25)
    assert (kwargs["min_tokens"], kwargs["ignore_eos"], kwargs["logprobs"]) == (3, True, 2)
    assert kwargs["logit_bias"] == {"7": -100} and kwargs["response_format"] == {"type": "json_object"}
    assert "logprobs" not in request(logprobs=np.array([[-1]], np.int32)).executor_kwargs()  # negative: none
    tools = '[{"type": "function", "function": {"name": "get_weather"}}]'
    assert request(chat=True, tools=text(tools)).tools[0]["function"]["name"] == "get_weather"
    assert request(chat=True, tools=text(tools), tool_choice=text('"none"')).tools is None
    for extra, words in [(dict(presence_penalty=np.array([[2.5]], np.float32)), "presence_penalty: 2.5 must be"),
                         (dict(logit_bias=text("{not json")), "logit_bias: not valid JSON"),
                         (dict(logit_bias=text('{"x": 1}')), "logit_bias: key 'x' is not a token id"),
                         (dict(logprobs=np.array([[21]], np.int32)), "logprobs: 21 must be an integer in [0, 20]"),
                         (dict(tools=text(tools)), "tools: only for chats"),
                         (dict(tool_choice=text('"required"')), "tool_choice: names a tool, but the request sends no"),
                         (dict(response_format=text("x" * 70000)), "response_format: 70000 bytes")]:
        with pytest.raises(RequestError, match=re.escape(words)):
            request(**extra)


def test_a_required_tool_choice_becomes_a_grammar_or_is_refused(tiny_pair):
    """tool_choice "required" becomes the request's response_format in a format that writes calls as text; where a
    call opens with a special token (Mistral) it is refused by name instead of silently acting as "auto"."""
    from transformers import AutoTokenizer

    def text(value: str):
        return np.array([[value.encode()]], dtype=np.object_)

    tools = '[{"type": "function", "function": {"name": "get_weather"}}]'
    args = parse_request({"messages": text('[{"role": "user", "content": "hi"}]'), "max_tokens": np.array([[8]], np.int32),
                          "tools": text(tools), "tool_choice": text('"required"')}.get, K_LIMIT, 64)
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair / "target")
    tokenizer.chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}{{ tools | tojson }}"
                               "{% endif %}<tool_call>")
    assert args.executor_kwargs(tokenizer)["response_format"]["type"] == "grammar"
    assert "response_format" not in args.executor_kwargs()  # no tokenizer, no format to write the call in
    tokenizer.chat_template = tokenizer.chat_template.replace("<tool_call>", "[TOOL_CALLS]")
    with pytest.raises(RequestError, match=r"^tool_choice: 'required' cannot be enforced .*mistral"):
        args.executor_kwargs(tokenizer)
