"""End to end: the real tritonserver (from the nvidia-pytriton wheel) on loopback serving the tiny torch engines.

One server per module (model load takes ~20 s on 2 cores). Clients: tritonclient HTTP and gRPC, the HTTP
generate endpoint, a gRPC decoupled stream, and a metrics scrape.
"""

from __future__ import annotations

import json
import queue
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

tritonclient_http = pytest.importorskip("tritonclient.http")
tritonclient_grpc = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from pipeline.executor import SpeculativeExecutor  # noqa: E402
from pipeline.triton.repository import deploy  # noqa: E402
from pipeline.triton.server import Endpoints, TritonServer  # noqa: E402
from triton_helpers import free_port  # noqa: E402

pytestmark = pytest.mark.server

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Parser:\n    def __init__(self", "x = [1, 2"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def executor(built_engines):
    config_path, engines = built_engines
    return SpeculativeExecutor.from_engines(engines / load_config(config_path).name, device="cpu")


@pytest.fixture(scope="module")
def expected(executor):
    """The executor's own greedy output for each prompt: what the server must return."""
    return {p: r for p, r in zip(PROMPTS, executor.generate(PROMPTS, max_new_tokens=MAX_TOKENS))}


@pytest.fixture(scope="module")
def server(built_engines, tmp_path_factory):
    config_path, engines = built_engines
    config = load_config(config_path)
    repo = deploy(config, engines).path
    endpoints = Endpoints("127.0.0.1", free_port(), free_port(), free_port())
    log = tmp_path_factory.mktemp("triton") / "server.log"
    running = TritonServer(repo, endpoints, log_path=log).start(ready_timeout_s=400)  # slow on a busy 2-core box
    try:
        yield running
    finally:
        running.stop()


def http_client(server):
    return tritonclient_http.InferenceServerClient(server.endpoints.http)


def grpc_client(server):
    return tritonclient_grpc.InferenceServerClient(server.endpoints.grpc)


def request_inputs(module, prompt: str, max_tokens: int = MAX_TOKENS, max_tokens_dtype=np.int32, **extra):
    arrays = {"text_input": np.array([[prompt.encode()]], dtype=np.object_),
              "max_tokens": np.array([[max_tokens]], dtype=max_tokens_dtype), **extra}
    inputs = []
    for name, array in arrays.items():
        dtype = "BYTES" if array.dtype == np.object_ else {
            np.int32: "INT32", np.float32: "FP32", np.uint64: "UINT64"}[array.dtype.type]
        tensor = module.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def test_http_greedy_matches_executor(server, expected):
    client = http_client(server)
    for prompt in PROMPTS[:2]:
        # K named explicitly: the server then drafts exactly K (no batch-wide cap), so the statistics match too
        result = client.infer("speculative", request_inputs(tritonclient_http, prompt,
                                                            num_draft_tokens=np.array([[4]], dtype=np.int32)))
        want = expected[prompt]
        assert result.as_numpy("output_ids")[0].tolist() == want.token_ids
        assert result.as_numpy("text_output")[0, 0].decode() == want.text
        assert int(result.as_numpy("draft_tokens")[0, 0]) == want.stats.draft_tokens
        assert int(result.as_numpy("accepted_tokens")[0, 0]) == want.stats.accepted_tokens
        assert int(result.as_numpy("target_steps")[0, 0]) == want.stats.target_steps
        assert result.as_numpy("acceptance_rate")[0, 0] == pytest.approx(want.stats.acceptance_rate, abs=1e-6)
        assert result.as_numpy("mean_accepted_len")[0, 0] == pytest.approx(want.stats.mean_accepted_len, abs=1e-6)


def test_grpc_greedy_matches_executor(server, expected):
    client = grpc_client(server)
    for prompt in PROMPTS[2:]:
        result = client.infer("speculative", request_inputs(tritonclient_grpc, prompt))
        assert result.as_numpy("output_ids")[0].tolist() == expected[prompt].token_ids
        assert result.as_numpy("finish_reason")[0, 0].decode() == expected[prompt].finish_reason


def test_http_generate_endpoint(server, expected):
    prompt = PROMPTS[0]
    body = json.dumps({"text_input": prompt, "max_tokens": MAX_TOKENS, "num_draft_tokens": 4}).encode()
    url = f"http://{server.endpoints.http}/v2/models/speculative/generate"
    with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=60) as response:
        data = json.loads(response.read())
    assert data["text_output"] == expected[prompt].text
    assert data["output_ids"] == expected[prompt].token_ids
    assert 0 <= data["accepted_tokens"] <= data["draft_tokens"]


def test_target_only_request_gives_same_tokens(server, expected):
    prompt = PROMPTS[1]
    result = http_client(server).infer("speculative", request_inputs(
        tritonclient_http, prompt, num_draft_tokens=np.array([[0]], dtype=np.int32)))
    assert result.as_numpy("output_ids")[0].tolist() == expected[prompt].token_ids
    assert int(result.as_numpy("draft_tokens")[0, 0]) == 0
    assert int(result.as_numpy("target_steps")[0, 0]) == MAX_TOKENS


def test_grpc_stream_is_incremental(server, expected):
    prompt = PROMPTS[0]
    responses: queue.Queue = queue.Queue()
    client = grpc_client(server)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("speculative_stream", request_inputs(tritonclient_grpc, prompt))
        steps = []
        for _ in range(MAX_TOKENS + 1):  # at most one response per token, plus slack
            result, error = responses.get(timeout=60)
            assert error is None, error
            steps.append(result)
            if result.as_numpy("finish_reason")[0, 0].decode():
                break
    finally:
        client.stop_stream()
    assert len(steps) > 1, "a stream must yield more than one response"
    ids = [t for step in steps for t in step.as_numpy("output_ids")[0].tolist()]
    text = "".join(step.as_numpy("text_output")[0, 0].decode() for step in steps)
    assert ids == expected[prompt].token_ids and text == expected[prompt].text
    assert len(steps) == int(steps[-1].as_numpy("target_steps")[0, 0])  # one response per target step


def test_eight_concurrent_clients(server, expected):
    jobs = [(PROMPTS[i % len(PROMPTS)], 4 + i) for i in range(8)]

    def one(job):
        prompt, n = job
        result = http_client(server).infer("speculative", request_inputs(tritonclient_http, prompt, n))
        return result.as_numpy("output_ids")[0].tolist()

    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(one, jobs))
    for (prompt, n), ids in zip(jobs, answers):
        # Greedy output for n tokens is the prefix of the longer greedy output (every n here is <= MAX_TOKENS).
        assert ids == expected[prompt].token_ids[:n], f"{prompt!r} with max_tokens {n}"


def test_bad_requests_get_errors_and_server_keeps_serving(server, expected):
    client = http_client(server)
    with pytest.raises(InferenceServerException, match="max_tokens: -3 must be an integer >= 0"):
        client.infer("speculative", request_inputs(tritonclient_http, PROMPTS[0], max_tokens=-3))
    with pytest.raises(InferenceServerException, match="exceeds max_input_len"):
        client.infer("speculative", request_inputs(tritonclient_http, "x = 1\n" * 400))
    with pytest.raises(InferenceServerException, match="max_tokens' data-type is 'FP32'.*expects 'INT32'"):
        client.infer("speculative", request_inputs(tritonclient_http, PROMPTS[0], max_tokens_dtype=np.float32))
    with pytest.raises(InferenceServerException, match="num_draft_tokens: 9"):
        client.infer("speculative", request_inputs(tritonclient_http, PROMPTS[0],
                                                   num_draft_tokens=np.array([[9]], dtype=np.int32)))
    url = f"http://{server.endpoints.http}/v2/models/speculative/generate"
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(urllib.request.Request(url, data=b'{"text_input": "x", "max_tokens": -1}'), timeout=60)
    assert info.value.code == 400 and "max_tokens" in info.value.read().decode()
    # The stream model reports errors in-band and keeps streaming for the next client.
    responses: queue.Queue = queue.Queue()
    stream = grpc_client(server)
    stream.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        stream.async_stream_infer("speculative_stream", request_inputs(tritonclient_grpc, PROMPTS[0], -1))
        _, error = responses.get(timeout=60)
    finally:
        stream.stop_stream()
    assert error is not None and "max_tokens: -1" in str(error)
    # Still serving, with unchanged answers.
    result = client.infer("speculative", request_inputs(tritonclient_http, PROMPTS[0]))
    assert result.as_numpy("output_ids")[0].tolist() == expected[PROMPTS[0]].token_ids
    assert client.is_server_live() and client.is_model_ready("speculative_stream")


def _metric(text: str, name: str, model: str, extra: str = "") -> float:
    pattern = rf'^{name}{{(?=[^}}]*model="{model}")(?=[^}}]*{extra})[^}}]*}} (\S+)$'
    values = [float(m.group(1)) for m in re.finditer(pattern, text, re.M)]
    assert values, f"{name} for model {model} not found in metrics"
    return sum(values)


def test_acceptance_metrics_are_exported(server):
    # One request of known statistics, then the counters must have grown by at least that much.
    result = http_client(server).infer("speculative", request_inputs(tritonclient_http, PROMPTS[3]))
    with urllib.request.urlopen(server.endpoints.metrics_url, timeout=30) as response:
        text = response.read().decode()
    drafted = _metric(text, "spec_draft_tokens_total", "speculative")
    accepted = _metric(text, "spec_accepted_tokens_total", "speculative")
    assert drafted >= int(result.as_numpy("draft_tokens")[0, 0]) > 0
    assert 0 < accepted <= drafted
    assert _metric(text, "spec_target_steps_total", "speculative") > 0
    assert _metric(text, "spec_generated_tokens_total", "speculative") > 0
    assert _metric(text, "spec_requests_total", "speculative", 'outcome="ok"') >= 1
    assert "# TYPE spec_draft_tokens_total counter" in text
    # the engine model counts all its work (proxied requests included) and reports its batch
    assert _metric(text, "spec_draft_tokens_total", "speculative_stream") >= drafted
    assert 0 <= _metric(text, "spec_batch_occupancy", "speculative_stream") <= 1
    assert _metric(text, "spec_queue_depth", "speculative_stream") >= 0
    assert "# TYPE spec_batch_occupancy gauge" in text
