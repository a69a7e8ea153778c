"""`python -m pipeline serve CONFIG --openai` end to end: the real tritonserver serving the tiny chat engines, the
OpenAI-compatible endpoint beside it, and the official `openai` client on loopback (one server for the module).

Answers equal the same request through Triton's own `speculative` model; streams concatenate to the whole answer;
stop strings cut the text and cancel the engine request; a client that goes away cancels its engine request (the
engine's `spec_requests_total{outcome="cancelled"}` counts it); bad requests are 400s naming the field, the model's
own validation messages included; SIGTERM stops both servers. The last part of the module checks the CLI's refusals,
which start no server.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from tests.conftest import one_error_line, run_cli, write_config  # noqa: E402
from tests.triton_helpers import Serve, free_ports, trtllm_config_dict  # noqa: E402

MODEL = "tiny-chat"  # the chat engines' config name: the endpoint's one model id
PROMPT = "def fibonacci(n):"
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
LONG = 480  # tokens an uncancelled request would run: > 1 s at one token per step (num_draft_tokens 0) here


def serve_config(source: Path, folder: Path) -> tuple[Path, dict]:
    data = yaml.safe_load(source.read_text())
    ports = dict(zip(("http_port", "grpc_port", "metrics_port", "openai_port"), free_ports(4)))
    data["serve"] = {"bind_address": "127.0.0.1", **ports}
    path = folder / source.name
    path.write_text(yaml.safe_dump(data))
    return path, ports


@pytest.fixture(scope="module")
def serving(chat_engines, tmp_path_factory):
    source, engines = chat_engines
    config, ports = serve_config(source, tmp_path_factory.mktemp("serve-openai"))
    serve = Serve(config, engines, "--openai")
    try:
        # model load: ~20 s idle, minutes on a busy 2-core box
        line = serve.wait_for(lambda text: text.startswith("OpenAI-compatible:"), 420)
        assert line, serve.text()
        yield serve, ports
    finally:
        if serve.process.poll() is None:
            serve.process.kill()
            serve.process.wait()


@pytest.fixture(scope="module")
def client(serving):
    _, ports = serving
    return openai.OpenAI(base_url=f"http://127.0.0.1:{ports['openai_port']}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def triton_generate(ports: dict, **body) -> dict:
    """The same request through Triton's own request/response model (HTTP generate)."""
    url = f"http://127.0.0.1:{ports['http_port']}/v2/models/speculative/generate"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def statistics(triton: dict) -> dict:
    return {name: pytest.approx(triton[name], abs=1e-6) for name in
            ("draft_tokens", "accepted_tokens", "target_steps", "acceptance_rate", "mean_accepted_len")}


def cancelled(ports: dict) -> float:
    """The engine model's count of requests that ended because their client cancelled them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics_port']}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    pattern = r'^spec_requests_total\{(?=[^}]*model="speculative_stream")(?=[^}]*outcome="cancelled")[^}]*\} (\S+)$'
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


def wait_for_cancelled(ports: dict, expected: float, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    while (now := cancelled(ports)) < expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return now


@pytest.mark.server
def test_serve_prints_the_url_and_lists_the_model(serving, client):
    serve, ports = serving
    url = f"http://127.0.0.1:{ports['openai_port']}/v1"
    assert any(line.startswith(f"OpenAI-compatible: {url}") for line in serve.output), serve.output
    assert [model.id for model in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "specpipe"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)


@pytest.mark.server
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.95, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_completion_equals_tritons_speculative_model(serving, client, sampling):
    _, ports = serving
    # K named explicitly: the engine then drafts exactly K for both, so the statistics match too
    ours = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, extra_body={"num_draft_tokens": 3},
                                     **sampling)
    theirs = triton_generate(ports, text_input=PROMPT, max_tokens=24, num_draft_tokens=3, **sampling)
    assert ours.choices[0].text == theirs["text_output"]
    assert ours.usage.completion_tokens == len(theirs["output_ids"]) == 24
    assert ours.usage.prompt_tokens == theirs["prompt_tokens"] and ours.choices[0].finish_reason == "length"
    assert ours.model == MODEL and ours.object == "text_completion"
    assert ours.model_extra["speculative"] == statistics(theirs)


@pytest.mark.server
def test_a_token_id_prompt_is_the_same_prompt(serving, client):
    from transformers import AutoTokenizer

    serve, _ = serving
    tokenizer = AutoTokenizer.from_pretrained(yaml.safe_load(serve.config.read_text())["target"]["model"])
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    assert by_ids.choices[0].text == by_text.choices[0].text


@pytest.mark.server
def test_chat_completion_equals_tritons_speculative_model(serving, client):
    _, ports = serving
    ours = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=12, temperature=0)
    theirs = triton_generate(ports, messages=json.dumps(CHAT), max_tokens=12, temperature=0.0)
    message = ours.choices[0].message
    assert message.role == "assistant" and message.content == theirs["text_output"]
    assert ours.usage.prompt_tokens == theirs["prompt_tokens"]  # the chat template's tokens, counted by the model
    assert ours.usage.completion_tokens == len(theirs["output_ids"]) and ours.object == "chat.completion"
    # without max_tokens a chat may use the room every accepted prompt leaves (max_seq_len 512 - max_input_len 256);
    # the tiny model never ends its turn greedily, so it uses all of it
    unbounded = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0)
    assert (unbounded.choices[0].finish_reason, unbounded.usage.completion_tokens) == ("length", 256)


@pytest.mark.server
def test_streamed_chunks_concatenate_to_the_whole_answer(serving, client):
    sampled = {"max_tokens": 40, "temperature": 1.0, "seed": 11}
    whole = client.completions.create(model=MODEL, prompt=PROMPT, **sampled)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **sampled))
    pieces, usage_chunk = chunks[:-1], chunks[-1]
    assert len(pieces) > 2 and all(chunk.id == pieces[0].id for chunk in chunks)
    assert "".join(chunk.choices[0].text for chunk in pieces) == whole.choices[0].text
    assert [chunk.choices[0].finish_reason for chunk in pieces] == [None] * (len(pieces) - 1) + ["length"]
    assert pieces[-1].model_extra["speculative"] == whole.model_extra["speculative"]
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage

    answer = client.chat.completions.create(model=MODEL, messages=CHAT, **sampled)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **sampled))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == answer.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason and chunks[-1].usage is None


@pytest.mark.server
def test_concurrent_requests_get_their_own_answers(client):
    from concurrent.futures import ThreadPoolExecutor

    jobs = [{"prompt": f"def f{i}(", "max_tokens": 8 + i, "temperature": 1.0, "seed": i} for i in range(6)]
    alone = [client.completions.create(model=MODEL, **job).choices[0].text for job in jobs]

    def one(job):
        if job["seed"] % 2:  # half of them streamed
            chunks = client.completions.create(model=MODEL, stream=True, **job)
            return "".join(chunk.choices[0].text for chunk in chunks)
        return client.completions.create(model=MODEL, **job).choices[0].text

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        assert list(pool.map(one, jobs)) == alone  # batched together on the engine, each its own answer


@pytest.mark.server
def test_raw_stream_is_server_sent_events_ending_in_done(serving):
    _, ports = serving
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "stream": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{ports['openai_port']}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert answer.headers["Content-Type"].startswith("text/event-stream")
        events = answer.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])


@pytest.mark.server
def test_stop_strings_cut_the_text_and_cancel_the_engine_request(serving, client):
    _, ports = serving
    # One token per step (K 0): the request would run well past the stop string if it were not cancelled.
    request = {"model": MODEL, "prompt": "def f(", "max_tokens": 300, "temperature": 1.0, "seed": 3,
               "extra_body": {"num_draft_tokens": 0}}
    full = client.completions.create(**request).choices[0].text
    assert len(full) > 60, full
    stop = full[30:33]
    expected = full[:full.index(stop)]
    before = cancelled(ports)
    cut = client.completions.create(stop=[stop, "\x00never"], **request)
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 300
    streamed = list(client.completions.create(stop=stop, stream=True, **request))
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert wait_for_cancelled(ports, before + 2) == before + 2  # both requests ended early in the engine


@pytest.mark.server
def test_a_client_that_goes_away_cancels_its_engine_request(serving, client):
    _, ports = serving
    long = {"model": MODEL, "prompt": "def g(y):", "max_tokens": LONG, "temperature": 0,
            "extra_body": {"num_draft_tokens": 0}}
    before = cancelled(ports)
    stream = client.completions.create(stream=True, **long)
    next(iter(stream))
    stream.close()  # the first chunk arrived; the client hangs up
    assert wait_for_cancelled(ports, before + 1) == before + 1
    with pytest.raises(openai.APITimeoutError):  # a non-streamed request whose client stops waiting
        client.with_options(timeout=0.3).completions.create(**long)
    assert wait_for_cancelled(ports, before + 2) == before + 2
    after = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    assert after.usage.completion_tokens == 5  # and the server keeps serving


@pytest.mark.server
@pytest.mark.parametrize("extra, param, words", [
    ({"n": 17}, "n", "n: 17 must be an integer in [1, 16]"),
    ({"logprobs": 6}, "logprobs", "logprobs: 6 must be an integer in [0, 5]"),
    ({"presence_penalty": 3}, "presence_penalty", "presence_penalty: 3.0 must be a number in [-2, 2]"),  # the model's
    ({"extra_body": {"response_format": {"type": "json_schema"}}}, "response_format", "response_format"),
    ({"temperature": -1}, "temperature", "temperature: -1.0 must be a finite number >= 0"),  # the model's check
    ({"temperature": -1, "stream": True}, "temperature", "temperature: -1.0 must be"),  # before the stream opens
    ({"extra_body": {"num_draft_tokens": 9}}, "num_draft_tokens", "larger than the 4 the target engine was built"),
    ({"max_tokens": 600}, "max_tokens", "exceeds max_seq_len 512"),
    ({"prompt": ["a", "b"]}, "prompt", "2 prompts in one request"),
], ids=["n", "logprobs", "penalty", "format", "temperature", "temperature-stream", "draft-len", "too-long",
        "two-prompts"])
def test_bad_completion_requests_are_400s_naming_the_field(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**{"model": MODEL, "prompt": PROMPT, **extra})
    assert info.value.status_code == 400 and info.value.param == param
    assert words in info.value.body["message"] and info.value.body["type"] == "invalid_request_error"


@pytest.mark.server
@pytest.mark.parametrize("extra, words", [
    ({"top_logprobs": 2}, "top_logprobs: only with logprobs: true"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages: message 0 role 'robot' is not one of"),
], ids=["logprobs", "role"])
def test_bad_chat_requests_are_400s_naming_the_field(client, extra, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{"model": MODEL, "messages": CHAT, **extra})
    assert words in info.value.body["message"]


def off(**extra) -> dict:
    """extra_body with speculation off (target-only decoding on the same engine)."""
    return {**extra, "num_draft_tokens": 0}


@pytest.mark.server
def test_logprobs_are_the_same_with_speculation_off_and_streamed(client):
    spec = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2,
                                     extra_body={"num_draft_tokens": 4})
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2,
                                      extra_body=off())
    got, want = spec.choices[0].logprobs, plain.choices[0].logprobs
    assert spec.choices[0].text == plain.choices[0].text and "".join(got.tokens) == spec.choices[0].text
    assert len(got.tokens) == spec.usage.completion_tokens == 16 and got.tokens == want.tokens
    assert got.token_logprobs == pytest.approx(want.token_logprobs, abs=1e-4) and max(got.token_logprobs) <= 0
    assert all(len(top) == 2 for top in got.top_logprobs) and got.text_offset[0] == 0
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2,
                                              stream=True, extra_body={"num_draft_tokens": 4}))
    tokens = [t for chunk in streamed if chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.tokens]
    assert tokens == got.tokens

    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=10, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content and len(content) == 10
    assert all(len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
               for entry in content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=10,
                                                 temperature=0, logprobs=True, top_logprobs=3, stream=True))
    streamed = [entry for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


@pytest.mark.server
def test_penalties_bias_and_min_tokens_equal_speculation_off(serving, client):
    _, ports = serving
    controls = {"presence_penalty": 0.7, "frequency_penalty": 0.9, "logit_bias": {"17": 3.0, "5": -100}}
    extra = {"repetition_penalty": 1.3, "min_tokens": 20}
    spec = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, **controls,
                                     extra_body=extra)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, **controls,
                                      extra_body=off(**extra))
    bare = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert spec.choices[0].text == plain.choices[0].text != bare.choices[0].text
    assert spec.model_extra["speculative"]["draft_tokens"] > 0  # speculation was on
    theirs = triton_generate(ports, text_input=PROMPT, max_tokens=24, temperature=0.0, presence_penalty=0.7,
                             frequency_penalty=0.9, logit_bias=json.dumps(controls["logit_bias"]), logprobs=1, **extra)
    assert theirs["text_output"] == spec.choices[0].text  # the same inputs through Triton's own model
    entries = json.loads(theirs["logprobs"])  # the steps' entries merged into one list by the proxy model
    assert [entry[0] for entry in entries] == theirs["output_ids"] and all(len(entry[3]) == 1 for entry in entries)


@pytest.mark.server
def test_n_choices_share_a_seed_and_stream_by_index(client):
    sampled = {"max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 3}
    first = client.completions.create(model=MODEL, prompt=PROMPT, **sampled)
    again = client.completions.create(model=MODEL, prompt=PROMPT, **sampled)
    texts = [choice.text for choice in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1 and first.usage.completion_tokens == 36
    # choice 0 is the request with that seed alone
    assert client.completions.create(model=MODEL, prompt=PROMPT, **{**sampled, "n": 1}).choices[0].text == texts[0]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **sampled))
    by_index = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)]
    assert by_index == texts
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=6, n=2, temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "Paris?"}]  # short: the tiny engines take 256 prompt tokens, the tool's JSON many
PERSON = {"type": "object", "properties": {"name": {"type": "string", "enum": ["ada", "grace"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.server
@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_answer_validates_and_forced_tokens_are_free_drafts(client, stream):
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    texts = []
    for seed in range(3):
        answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=48, temperature=0.8,
                                                seed=seed, response_format=fmt, stream=stream)
        if stream:
            chunks = list(answer)
            texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            texts.append(answer.choices[0].message.content)
            assert answer.choices[0].finish_reason == "stop"  # the grammar ended the turn
            # the keys and punctuation the schema fixes were drafted by the grammar and accepted
            assert answer.model_extra["speculative"]["accepted_tokens"] > 0
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    greedy = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=48, temperature=0,
                                            response_format=fmt)
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=48, temperature=0,
                                           response_format=fmt, extra_body=off())
    assert greedy.choices[0].message.content == plain.choices[0].message.content
    assert greedy.model_extra["speculative"]["target_steps"] < plain.model_extra["speculative"]["target_steps"]


@pytest.mark.server
@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_parsed_and_an_agent_loop_continues(client, stream):
    # The tiny model never calls a tool by itself: a regex format makes it write one, in the template's format.
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    force = {"response_format": {"type": "regex", "regex": re.escape(call)}}
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_completion_tokens=64,
                                            temperature=0, stream=stream, extra_body=force)
    if stream:
        chunks = list(answer)
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
        assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}
        assert not any(c.choices[0].delta.content for c in chunks if c.choices)  # no marker leaked as content
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        return
    choice = answer.choices[0]
    (tool_call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert tool_call.function.name == "get_weather" and json.loads(tool_call.function.arguments) == {"city": "Paris"}
    loop = [*ASK, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tool_call.id, "content": "18 C, sunny"}]
    after = client.chat.completions.create(model=MODEL, messages=loop, tools=[WEATHER], max_completion_tokens=4,
                                           temperature=0)
    assert after.usage.prompt_tokens > answer.usage.prompt_tokens and after.choices[0].finish_reason == "length"


@pytest.mark.server
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_required_tool_choice_always_calls_the_tool(client, choice):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
    for seed in range(3):
        answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=[tool], tool_choice=choice,
                                                max_completion_tokens=64, temperature=1.0, seed=seed)
        (tool_call,) = answer.choices[0].message.tool_calls
        assert answer.choices[0].finish_reason == "tool_calls" and tool_call.function.name == "get_weather"
        assert set(json.loads(tool_call.function.arguments)) == {"city"}
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=[tool], max_completion_tokens=8,
                                          temperature=0)
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].finish_reason == "length"


@pytest.mark.server
def test_sigterm_stops_the_endpoint_and_triton(serving, client):
    # Last of the live tests: it ends the module's server.
    serve, ports = serving
    serve.process.send_signal(signal.SIGTERM)
    assert serve.process.wait(timeout=90) == 0
    with pytest.raises(openai.APIConnectionError):
        client.models.list()
    for port in ports.values():
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))  # nothing listens any more


# ---- the CLI's refusals: no server starts ---------------------------------------------------------------------------

def test_openai_port_in_use_fails_before_anything_starts(chat_engines, tmp_path):
    source, engines = chat_engines
    config, ports = serve_config(source, tmp_path)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", ports["openai_port"]))
        holder.listen()
        result = run_cli("serve", str(config), "--engines-dir", str(engines), "--openai", timeout=120)
    line = one_error_line(result)
    assert line.startswith(f"error: serve.openai_port: {ports['openai_port']} on 127.0.0.1 is in use"), line
    assert "repository" not in result.stdout and "starting tritonserver" not in result.stdout


def test_openai_port_must_differ_from_tritons(chat_engines, tmp_path):
    source, engines = chat_engines
    config, ports = serve_config(source, tmp_path)
    result = run_cli("serve", str(config), "--engines-dir", str(engines), "--openai", "--openai-port",
                     str(ports["grpc_port"]), timeout=120)
    assert f"--openai-port: {ports['grpc_port']} is also serve.grpc_port" in one_error_line(result)


def test_openai_is_refused_for_trtllm_with_the_reason(tmp_path, capsys):
    from pipeline.cli import main

    path = write_config(tmp_path, trtllm_config_dict("cli-openai"))
    assert main(["serve", str(path), "--engines-dir", str(tmp_path / "engines"), "--openai"]) == 2
    error = capsys.readouterr().err
    assert "--openai: not for the trtllm backend" in error and "OpenAI-compatible frontend" in error
    assert not (tmp_path / "engines").exists()  # refused before deploying anything
