"""The OpenAI endpoint on the real model (SmolLM2-135M-Instruct, the shipped n-gram config) with the official
`openai` client: logprobs, penalties and bias, n, a JSON schema and tools, streamed and not, each under speculation
and against speculation off (`num_draft_tokens: 0`) on the same server."""

from __future__ import annotations

import json

import pytest
import yaml

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("uvicorn")

from tests.conftest import REPO  # noqa: E402
from tests.triton_helpers import Serve, free_ports  # noqa: E402

MODEL = "smollm2-135m-ngram"
ASK = [{"role": "user", "content": "Rename x to count in: def f(x): return x + 1"}]
PLACE = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "country": {"type": "string", "enum": ["France", "Germany", "Italy", "Spain"]}},
    "required": ["city", "country"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(real_model_dir, tmp_path_factory):
    from pipeline.config import load_config
    from pipeline.stages import run_stages

    folder = tmp_path_factory.mktemp("real-openai")
    data = yaml.safe_load((REPO / "configs" / f"{MODEL}.yaml").read_text())
    data["target"]["model"] = str(real_model_dir)
    data["build"] = {**data["build"], "max_batch_size": 4, "max_input_len": 512, "max_seq_len": 1024}
    ports = dict(zip(("http_port", "grpc_port", "metrics_port", "openai_port"), free_ports(4)))
    data["serve"] = {"bind_address": "127.0.0.1", **ports}
    config = folder / f"{MODEL}.yaml"
    config.write_text(yaml.safe_dump(data))
    run_stages(load_config(config), folder / "engines", ("convert", "build"))
    serve = Serve(config, folder / "engines", "--openai")
    try:
        assert serve.wait_for(lambda text: text.startswith("OpenAI-compatible:"), 420), serve.text()
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{ports['openai_port']}/v1", api_key="unused",
                            max_retries=0, timeout=300)
    finally:
        serve.process.kill()
        serve.process.wait()


@pytest.mark.slow
@pytest.mark.server
def test_every_feature_on_the_real_model(client):
    controls = {"presence_penalty": 0.4, "frequency_penalty": 0.6, "logit_bias": {"28": -5}, "logprobs": True,
                "top_logprobs": 2}
    spec = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=32, temperature=0, **controls)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=32, temperature=0, **controls,
                                           extra_body={"num_draft_tokens": 0})
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.model_extra["speculative"]["draft_tokens"] > 0 == plain.model_extra["speculative"]["draft_tokens"]
    got, want = spec.choices[0].logprobs.content, plain.choices[0].logprobs.content
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-4)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=32, temperature=0,
                                                 stream=True, **controls))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == spec.choices[0].message.content

    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE}}
    ask = [{"role": "user", "content": "Where is the Eiffel Tower? Answer in JSON."}]
    for stream in (False, True):
        answer = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=48, temperature=0.7, seed=1,
                                                n=2, response_format=fmt, stream=stream)
        if stream:
            chunks = list(answer)
            texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                     for i in range(2)]
        else:
            texts = [choice.message.content for choice in answer.choices]
            assert answer.model_extra["speculative"]["accepted_tokens"] > 0
        for text in texts:
            jsonschema.validate(json.loads(text), PLACE)

    with pytest.raises(openai.BadRequestError) as info:  # SmolLM2's chat template renders no tools
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, tools=[
            {"type": "function", "function": {"name": "get_weather"}}])
    assert info.value.param == "tools"
