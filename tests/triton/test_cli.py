"""pipeline/triton/cli.py: `python -m pipeline deploy` and `serve`.

`serve` starts tritonserver on loopback behind its fronts, prints the endpoints, answers, and stops cleanly on
SIGTERM. Against hostile clients and curious local users (real tritonserver on loopback, marked server): no
client can load code or reach the admin APIs whatever it read of any process's argv, no secret reaches argv or the
server's environment, the shared memory is private, cross-site and keyless requests are refused, oversized bodies
are refused before Triton, a dead model process fails the requests in flight within seconds and serve restarts the
server (then, past the restart budget, exits non-zero at once), a port held by another server is never taken for
ours, and a second signal never leaves tritonserver behind. The port flags (--http-port, --grpc-port,
--metrics-port, --openai-port) override the config's serve ports, stay distinct, and errors name the flag. For
trtllm configs `deploy` writes the repository and `serve` says how to launch it.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from pipeline.triton import procfs
from tests.conftest import PY, REPO, one_error_line, run_cli, write_config
from tests.triton_helpers import Serve, _children, free_ports, process_tree_rss, trtllm_config_dict


SECRET = "hf_reliabilitySECRET0123456789"
# Credentials named the way people name them, which a deny-list of suffixes let through to the model processes.
OTHER_SECRETS = {"OPENAI_KEY": "sk-otherSECRET42", "DATABASE_URL": "postgres://u:dbSECRET42@db/x",
                 "MY_PASSWD": "passwdSECRET42", "GITHUB_PAT": "ghp_patSECRET42"}
API_KEY = "keySECRET-0123456789abcdef"
KEY = {"Authorization": f"Bearer {API_KEY}"}
GRPC_KEY = {"authorization": f"Bearer {API_KEY}"}  # gRPC metadata names are lowercase
JSON = {"Content-Type": "application/json"}


def _config(source: Path, folder: Path, **serve) -> Path:
    """``source`` with serve on loopback ports of its own; ``openai_port=True`` takes one more."""
    data = yaml.safe_load(source.read_text())
    http, grpc, metrics, openai = free_ports(4)
    if serve.get("openai_port") is True:
        serve["openai_port"] = openai
    data["serve"] = {"bind_address": "127.0.0.1", "http_port": http, "grpc_port": grpc, "metrics_port": metrics,
                     **serve}
    path = folder / source.name
    path.write_text(yaml.safe_dump(data))
    return path


def _ports(config: Path) -> dict:
    return yaml.safe_load(config.read_text())["serve"]


def _post(url: str, body: bytes, timeout: float = 60, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={**JSON, **KEY} if headers is None else headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _generate(port: int, text: str | bytes = "def f(x):", max_tokens=4, timeout: float = 60, headers=None,
              **fields):
    text = text.decode() if isinstance(text, bytes) else text
    body = json.dumps({"text_input": text, "max_tokens": max_tokens, **fields}).encode()
    return _post(f"http://127.0.0.1:{port}/v2/models/speculative/generate", body, timeout, headers)


def _stubs(triton_pid: int) -> dict[str, list[int]]:
    """model name -> pids of its live Python-backend stub processes."""
    found: dict[str, list[int]] = {}
    for pid in _children(triton_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if argv[0].endswith(b"triton_python_backend_stub") and state not in "ZX":
            found.setdefault(Path(argv[1].decode()).parent.parent.name, []).append(pid)
    return found


def _triton_http(triton_pid: int) -> int:
    """tritonserver's own (loopback) HTTP port, read from its argv as a local user can."""
    argv = Path(f"/proc/{triton_pid}/cmdline").read_bytes().decode().split("\0")
    return int(next(a for a in argv if a.startswith("--http-port=")).split("=")[1])


@pytest.fixture(scope="module")
def serving(built_engines, tmp_path_factory):
    config_path, engines = built_engines
    folder = tmp_path_factory.mktemp("reliability-serve")
    config = _config(config_path, folder, api_key_env="SPECPIPE_TEST_KEY")
    serve = Serve(config, engines, "--max-restarts", "2", "--log-file", str(folder / "triton.log"),
                  env={"HF_TOKEN": SECRET, "HUGGING_FACE_HUB_TOKEN": SECRET, "SPECPIPE_TEST_KEY": API_KEY,
                       **OTHER_SECRETS})
    try:
        assert serve.wait_for(lambda line: line.startswith("ready:"), 420), serve.text()
        yield serve, config, engines
    finally:
        serve.close()


@pytest.mark.server
def test_no_client_reaches_the_admin_apis_whatever_it_read_of_argv(serving):
    serve, config, _ = serving
    triton = serve.triton_pid
    argv = Path(f"/proc/{triton}/cmdline").read_bytes().decode().split("\0")
    assert "--model-control-mode=none" in argv
    # The admin APIs' key as a local user reads it off the command line (Triton's format: apis:header=value), sent
    # as near as HTTP allows: a header name ends at its first colon.
    read_off = {}
    for arg in argv:
        if arg.startswith("--http-restricted-api=") and "model-repository" in arg:
            header, _, value = arg.split(":", 1)[1].partition("=")
            name, _, rest = header.partition(":")
            read_off[name] = f"{rest}={value}" if rest else value
    assert read_off
    model_code = {"parameters": {"config": json.dumps({"backend": "python"}),
                                 "file:1/model.py": "aW1wb3J0IG9zCm9zLnN5c3RlbSgidG91Y2ggL3RtcC9wd25lZCIp"}}
    for port in (_ports(config)["http_port"], _triton_http(triton)):
        base = f"http://127.0.0.1:{port}/v2"
        for headers in ({**JSON, **KEY}, {**JSON, **KEY, **read_off}):
            load = _post(f"{base}/repository/models/evil/load", json.dumps(model_code).encode(), headers=headers)
            assert load[0] == 403, load
            assert _post(f"{base}/repository/models/speculative/unload", b"{}", headers=headers)[0] == 403
            assert _post(f"{base}/logging", json.dumps({"log_verbose_level": 3}).encode(), headers=headers)[0] == 403
            assert _post(f"{base}/trace/setting", json.dumps({"trace_level": ["TIMESTAMPS"]}).encode(),
                         headers=headers)[0] == 403
            assert _post(f"{base}/systemsharedmemory/region/x/register",
                         json.dumps({"key": "/x", "offset": 0, "byte_size": 8}).encode(), headers=headers)[0] == 403
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{_ports(config)['grpc_port']}")
    for call in (lambda: client.update_log_settings({"log_verbose_level": 3}, headers=GRPC_KEY),
                 lambda: client.unload_model("speculative", headers=GRPC_KEY),
                 lambda: client.load_model("speculative", headers={**GRPC_KEY, **read_off})):
        with pytest.raises(InferenceServerException, match="restricted"):
            call()
    assert client.is_model_ready("speculative", headers=GRPC_KEY)
    assert not Path("/tmp/pwned").exists()
    status, answer = _generate(_ports(config)["http_port"])
    assert status == 200 and len(answer["output_ids"]) == 4, answer


@pytest.mark.server
def test_no_secret_in_argv_or_in_the_server_environment(serving):
    serve, _, _ = serving
    triton = serve.triton_pid
    stubs = [pid for pids in _stubs(triton).values() for pid in pids]
    assert stubs
    secrets = [SECRET, API_KEY, *OTHER_SECRETS.values()]
    assert SECRET.encode() in Path(f"/proc/{serve.process.pid}/environ").read_bytes()  # the test set it
    for pid in [serve.process.pid, triton, *stubs]:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{pid}/environ").read_bytes() if pid != serve.process.pid else b""
        for secret in secrets:
            assert secret.encode() not in argv, (pid, secret)
            assert secret.encode() not in environ, (pid, secret)


@pytest.mark.server
def test_model_shared_memory_is_private(serving):
    serve, _, _ = serving
    regions = [stub.shm_region for stub in procfs.stubs(serve.triton_pid)]
    assert regions
    for region in regions:
        mode = stat.S_IMODE((procfs.SHM_DIR / region.lstrip("/")).stat().st_mode)
        assert mode == 0o600, (region, oct(mode))


@pytest.mark.server
def test_cross_site_and_keyless_requests_are_refused(serving):
    _, config, _ = serving
    http = _ports(config)["http_port"]
    body = json.dumps({"text_input": "def f(x):", "max_tokens": 2}).encode()
    url = f"http://127.0.0.1:{http}/v2/models/speculative/generate"
    assert _post(url, body, headers={**JSON, **KEY, "Host": "evil.example"})[0] in (400, 421)  # DNS rebinding
    assert _post(url, body, headers={**KEY, "Content-Type": "text/plain"})[0] == 415  # no preflight needed
    assert _post(url, body, headers={**JSON, **KEY, "Origin": "http://evil.example"})[0] == 403
    assert _post(url, body, headers=JSON)[0] == 401
    assert _post(url, body, headers={**JSON, "Authorization": "Bearer wrong"})[0] == 401
    assert _post(url, body)[0] == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=10) as ready:
        assert ready.status == 200  # health checks need no key
    # Triton's own port behind the front answers only its exact Host name: a rebinding page never reaches it.
    inner = _triton_http(serving[0].triton_pid)
    assert _post(f"http://localhost:{inner}/v2/models/speculative/generate", body, headers=JSON)[0] == 403


@pytest.mark.server
def test_metrics_port_tells_nothing_of_other_clients_prompts(serving):
    _, config, _ = serving
    shared = "def helper(value):\n    return value + 1\n\n" * 8  # several KV blocks: a second send reuses them
    for _ in range(2):
        assert _generate(_ports(config)["http_port"], shared)[0] == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{_ports(config)['metrics_port']}/metrics", timeout=30) as page:
        text = page.read().decode()
    assert "spec_engine_steps_total" in text  # the engine's own counters are there
    assert "spec_prefix" not in text  # whether a guessed prompt was cached is not


@pytest.mark.server
def test_oversized_body_is_refused_before_triton(serving):
    import numpy as np
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    serve, config, _ = serving
    http = _ports(config)["http_port"]
    engine_stub = _stubs(serve.triton_pid)["speculative_stream"][0]
    rss_before = process_tree_rss(engine_stub)[engine_stub]
    client = httpclient.InferenceServerClient(f"127.0.0.1:{http}", network_timeout=120)
    text = httpclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"x" * (10 * 2**20)]], dtype=np.object_))  # binary body, as tritonclient
    max_tokens = httpclient.InferInput("max_tokens", [1, 1], "INT32")
    max_tokens.set_data_from_numpy(np.array([[4]], dtype=np.int32))
    start = time.perf_counter()
    with pytest.raises(InferenceServerException, match="byte limit"):  # 10 MB: 19-27 s of tokenizing unchecked
        client.infer("speculative", [text, max_tokens], headers=KEY)
    assert time.perf_counter() - start < 10
    # Under the front's limit, the model's own check refuses a prompt over max_input_len before tokenizing.
    text.set_data_from_numpy(np.array([[b"x" * (2**20)]], dtype=np.object_))
    with pytest.raises(InferenceServerException, match="text_input: 1048576 bytes is over the"):
        client.infer("speculative", [text, max_tokens], headers=KEY)
    start = time.perf_counter()
    assert _generate(http)[0] == 200
    assert time.perf_counter() - start < 10
    grown = process_tree_rss(engine_stub)[engine_stub] - rss_before
    assert grown < 100 * 2**20, f"engine process grew by {grown / 2**20:.0f} MB"  # it grew ~1.8 GB


@pytest.mark.server
def test_max_tokens_beyond_int32_is_refused(serving):
    _, config, _ = serving
    status, answer = _generate(_ports(config)["http_port"], max_tokens=2**31)
    assert status == 400 and "wrapped around" in answer["error"], answer


@pytest.mark.server
def test_second_serve_of_the_same_config_never_reports_ready(serving):
    serve, config, engines = serving
    second = Serve(config, engines, env={"SPECPIPE_TEST_KEY": API_KEY})
    try:
        assert second.process.wait(timeout=120) != 0, second.text()
    finally:
        second.close()
    text = second.text()
    assert "ready:" not in text, text
    assert f"{_ports(config)['http_port']}" in text and "in use" in text, text
    assert _generate(_ports(config)["http_port"])[0] == 200  # the first server is untouched


@pytest.mark.server
def test_taken_metrics_port_is_refused_before_starting(built_engines, tmp_path):
    config_path, engines = built_engines
    config = _config(config_path, tmp_path)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", _ports(config)["metrics_port"]))
        holder.listen()
        serve = Serve(config, engines)
        try:
            code = serve.process.wait(timeout=120)
        finally:
            serve.close()
    text = serve.text()
    assert code != 0 and "ready:" not in text, text
    assert f"serve.metrics_port: {_ports(config)['metrics_port']}" in text and "in use" in text, text


@pytest.mark.server
def test_crashed_tritonserver_is_restarted(serving):
    serve, config, _ = serving
    http = _ports(config)["http_port"]
    crashed = serve.triton_pid
    os.kill(crashed, signal.SIGSEGV)  # as Triton 2.51 itself does on a JSON body over ~4 MB (the front refuses those)
    assert serve.wait_for(lambda line: "tritonserver restarted" in line, 240), serve.text()
    assert serve.triton_pid != crashed and "signal 11" in serve.text()
    status, answer = _generate(http)
    assert status == 200 and len(answer["output_ids"]) == 4, answer


def _stream_until_error(grpc_port: int, first_token: threading.Event, headers: dict | None = None,
                        go: threading.Barrier | None = None, draft_tokens: int | None = None) -> str:
    """A long gRPC stream: what ends it (an error text, or "finished"); ``first_token`` is set when it is running.
    With ``go``, the request is sent when the barrier opens (the stream itself is open by then); ``draft_tokens``:
    the request's num_draft_tokens."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((result, error)),
                        headers=GRPC_KEY if headers is None else headers)
    inputs = [grpcclient.InferInput("text_input", [1, 1], "BYTES"), grpcclient.InferInput("max_tokens", [1, 1], "INT32")]
    inputs[0].set_data_from_numpy(np.array([[b"def f(x):"]], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([[400]], dtype=np.int32))
    if draft_tokens is not None:
        inputs.append(grpcclient.InferInput("num_draft_tokens", [1, 1], "INT32"))
        inputs[-1].set_data_from_numpy(np.array([[draft_tokens]], dtype=np.int32))
    if go is not None:
        go.wait(60)
    client.async_stream_infer("speculative_stream", inputs)
    try:
        while True:
            result, error = events.get(timeout=120)
            if error is not None:
                return str(error)
            first_token.set()
            if result.as_numpy("finish_reason").reshape(-1)[0]:
                return "finished"
    finally:
        first_token.set()
        client.stop_stream(cancel_requests=True)


def _wait_running(metrics_port: int, config: Path, count: int, timeout: float = 60) -> bool:
    """Whether the engine's occupancy gauge reached ``count`` running requests within ``timeout`` seconds."""
    want = count / yaml.safe_load(config.read_text())["build"]["max_batch_size"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as page:
            lines = page.read().decode().splitlines()
        if any(line.startswith("spec_batch_occupancy{") and 'model="speculative_stream"' in line
               and float(line.rsplit(" ", 1)[1]) >= want - 1e-6 for line in lines):
            return True
        time.sleep(0.01)
    return False


@pytest.mark.server
def test_dead_model_process_fails_requests_in_flight_then_serve_restarts_then_gives_up(serving):
    # Last in this module: it ends the module's server. serve runs with --max-restarts 2, one used by the crash test.
    serve, config, _ = serving
    ports = _ports(config)
    triton = serve.triton_pid
    # the crash test above restarted it once already
    restarting, restarts = serve.text().count("restarting tritonserver"), serve.text().count("tritonserver restarted")
    running, go = threading.Event(), threading.Barrier(4)

    def generate():
        go.wait(60)
        return _generate(ports["http_port"], max_tokens=400, timeout=120, num_draft_tokens=0)

    # The three must be in the engine together when it dies: sent at once, without drafting (one token a step, a
    # few seconds each; drafting, the tiny pair ends them in under one), and the engine killed as soon as its
    # occupancy gauge shows all three running.
    engine = _stubs(triton)["speculative_stream"][0]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        in_flight = [pool.submit(generate), pool.submit(generate),
                     pool.submit(_stream_until_error, ports["grpc_port"], running, None, go, 0)]
        go.wait(60)
        assert _wait_running(ports["metrics_port"], config, 3), [f.result() for f in in_flight]
        killed = time.monotonic()
        os.kill(engine, signal.SIGKILL)  # what the kernel's OOM killer does
        outcomes = [future.result(timeout=60) for future in in_flight]
        ended_after = time.monotonic() - killed
    assert ended_after < 15, (ended_after, outcomes)  # they hung forever (> 120 s) before
    assert outcomes[0][0] >= 500 and outcomes[1][0] >= 500, outcomes
    assert outcomes[2] != "finished", outcomes
    # serve restarts it on the stub's death; under load Triton 2.51 sometimes aborts (signal 6) on it first, and
    # serve then restarts it for that: either way, one restart.
    deadline = time.monotonic() + 240
    while serve.text().count("tritonserver restarted") == restarts and time.monotonic() < deadline:
        assert serve.process.poll() is None, serve.text()
        time.sleep(0.5)
    assert serve.text().count("restarting tritonserver") == restarting + 1, serve.text()
    status, answer = _generate(ports["http_port"])
    assert status == 200 and len(answer["output_ids"]) == 4, (answer, serve.text())
    triton = serve.triton_pid
    os.kill(_stubs(triton)["speculative_stream"][0], signal.SIGKILL)  # a third restart: over the budget of 2
    died = time.monotonic()
    assert serve.process.wait(timeout=120) != 0, serve.text()
    assert time.monotonic() - died < 8, serve.text()  # no wait for the dead model's requests (Triton's 15 s)
    assert "restart" in serve.text()
    with pytest.raises(urllib.error.URLError):  # reported not ready: nothing answers any more
        urllib.request.urlopen(f"http://127.0.0.1:{ports['http_port']}/v2/health/ready", timeout=5)
    assert not procfs.alive(triton)


@pytest.mark.server
def test_second_signal_kills_tritonserver_before_serve_exits(built_engines, tmp_path):
    config_path, engines = built_engines
    config = _config(config_path, tmp_path)
    serve = Serve(config, engines)
    try:
        assert serve.wait_for(lambda line: line.startswith("ready:"), 420), serve.text()
        triton = serve.triton_pid
        stubs = [pid for pids in _stubs(triton).values() for pid in pids]
        scratch = list(Path(tempfile.gettempdir()).glob(f"specpipe-triton-{serve.process.pid}-*"))
        assert len(scratch) == 1, scratch
        # A stream that stalls in the engine: the graceful stop would wait serve.drain_timeout_s (15 s) for it.
        running = threading.Event()
        stream = threading.Thread(target=lambda: _stream_until_error(_ports(config)["grpc_port"], running,
                                                                     headers={}), daemon=True)
        stream.start()
        assert running.wait(60)
        os.kill(_stubs(triton)["speculative_stream"][0], signal.SIGSTOP)
        serve.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        serve.process.send_signal(signal.SIGTERM)  # an impatient operator (or a supervisor's second signal)
        second_signal = time.monotonic()
        code = serve.process.wait(timeout=60)
        exited_after = time.monotonic() - second_signal
        gone = [pid for pid in [triton, *stubs] if not procfs.alive(pid)]  # exited (a zombie awaits its reaper)
    finally:
        serve.close()
    print(f"serve exited {exited_after:.2f} s after the second signal")
    assert code == 130, serve.text()
    # at once: the graceful stop would have waited for the stalled stream, a kill takes well under a second
    assert exited_after < 3, (exited_after, serve.text())
    assert gone == [triton, *stubs], serve.text()  # at the moment serve exited, nothing of the server was left
    assert not scratch[0].exists()
    for port in _ports(config).values():
        if isinstance(port, int):
            with socket.socket() as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind; TIME_WAIT is fine
                probe.bind(("127.0.0.1", port))  # nothing listens any more


@pytest.mark.server
def test_sigterm_ends_running_openai_streams_in_band(built_engines, tmp_path):
    # drain_timeout_s 0: the drain deadline passes at once, so the running streams must be ended, not cut.
    config_path, engines = built_engines
    config = _config(config_path, tmp_path, drain_timeout_s=0, openai_port=True)
    serve = Serve(config, engines, "--openai")
    try:
        assert serve.wait_for(lambda line: line.startswith("OpenAI-compatible:"), 420), serve.text()
        body = json.dumps({"model": "tiny-built", "prompt": "def f(x):", "max_tokens": 250, "stream": True,
                           "temperature": 1.0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{_ports(config)['openai_port']}/v1/completions",
                                         data=body, headers=JSON)
        with urllib.request.urlopen(request, timeout=60) as answer:
            first = answer.readline()
            assert first.startswith(b"data: {"), first
            serve.process.send_signal(signal.SIGTERM)
            events = [line for line in answer.read().decode().splitlines() if line.startswith("data: ")]
        assert serve.process.wait(timeout=60) == 0, serve.text()
    finally:
        serve.close()
    assert events[-1] == "data: [DONE]", events[-3:]  # the official client raised APIConnectionError on a cut
    last = json.loads(events[-2].removeprefix("data: "))
    assert "error" in last or last["choices"][0]["finish_reason"] in ("length", "stop"), last


def _serve_args(*argv: str):
    from pipeline.cli import build_parser

    return build_parser().parse_args(["serve", "c.yaml", *argv])


def test_port_flags_override_the_config_serve_ports_and_nothing_else():
    from pipeline.config import parse_config
    from pipeline.triton.cli import with_port_flags

    config = parse_config({"name": "p", "target": {"model": "a/b"}, "draft": {"model": "a/c"},
                           "serve": {"http_port": 9100, "grpc_port": 9101, "metrics_port": 9102, "openai_port": 9103,
                                     "max_connections": 7}}, base_dir=Path("/somewhere"))
    served = with_port_flags(config, _serve_args("--http-port", "9200", "--grpc-port", "9201", "--metrics-port",
                                                 "9202", "--openai", "--openai-port", "9203"))
    s = served.serve
    assert (s.http_port, s.grpc_port, s.metrics_port, s.openai_port) == (9200, 9201, 9202, 9203)
    assert s.max_connections == 7 and served.base_dir == config.base_dir and served.target == config.target
    assert config.serve.http_port == 9100  # the loaded config is not changed
    one = with_port_flags(config, _serve_args("--metrics-port", "9300")).serve
    assert (one.http_port, one.grpc_port, one.metrics_port, one.openai_port) == (9100, 9101, 9300, 9103)
    assert with_port_flags(config, _serve_args()) is config


@pytest.mark.parametrize("argv, message", [
    (("--http-port", "9101"), "--http-port: 9101 is also serve.grpc_port; "),
    (("--grpc-port", "9300", "--metrics-port", "9300"), "--grpc-port: 9300 is also --metrics-port; "),
    (("--metrics-port", "9103"), "--metrics-port: 9103 is also serve.openai_port; "),
    (("--openai", "--openai-port", "9100"), "--openai-port: 9100 is also serve.http_port; "),
])
def test_port_flags_must_differ_from_the_other_ports_and_errors_name_the_flag(argv, message):
    from pipeline.config import parse_config
    from pipeline.errors import PipelineError
    from pipeline.triton.cli import with_port_flags

    config = parse_config({"name": "p", "target": {"model": "a/b"}, "draft": {"model": "a/c"},
                           "serve": {"http_port": 9100, "grpc_port": 9101, "metrics_port": 9102, "openai_port": 9103}})
    with pytest.raises(PipelineError) as err:
        with_port_flags(config, _serve_args(*argv))
    assert str(err.value).startswith(message), str(err.value)


def test_a_port_in_use_is_named_by_the_flag_that_chose_it():
    from pipeline.triton.cli import _name_port_flags

    message = ("serve.http_port: 9000 on 127.0.0.1 is in use (Address already in use); stop it or choose free ports "
               "in the config's serve section")
    assert _name_port_flags(message, _serve_args("--http-port", "9000")).startswith("--http-port: 9000 on ")
    assert _name_port_flags(message, _serve_args("--grpc-port", "9001")) == message  # http came from the config


def test_port_flags_on_the_command_line(tmp_path):
    """Without a server: a port out of range is argparse's usage error naming the flag, a clash is one error line
    naming the flag (before any engine is looked at), and the trtllm backend refuses the flags."""
    bad = run_cli("serve", "configs/tiny.yaml", "--grpc-port", "70000")
    assert bad.returncode == 2 and "argument --grpc-port: 70000 is not a port number" in bad.stderr, bad.stderr
    data = yaml.safe_load(Path(REPO / "configs/tiny.yaml").read_text())
    data["serve"] = {"http_port": 9100, "grpc_port": 9101, "metrics_port": 9102, "openai_port": 9103}
    config = write_config(tmp_path, data)
    line = one_error_line(run_cli("serve", str(config), "--engines-dir", str(tmp_path / "none"), "--http-port",
                                  "9102"))
    assert line.startswith("error: --http-port: 9102 is also serve.metrics_port"), line
    trtllm = write_config(tmp_path, trtllm_config_dict("ports"))
    line = one_error_line(run_cli("serve", str(trtllm), "--engines-dir", str(tmp_path / "e"), "--http-port", "9000"))
    assert line.startswith("error: --http-port: not for the trtllm backend"), line


@pytest.mark.server
def test_a_taken_port_given_by_flag_is_refused_naming_the_flag(built_engines, tmp_path):
    config_path, engines = built_engines
    config = _config(config_path, tmp_path)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        taken = holder.getsockname()[1]
        holder.listen()
        result = run_cli("serve", str(config), "--engines-dir", str(engines), "--http-port", str(taken))
    line = one_error_line(result)
    assert line.startswith(f"error: --http-port: {taken} on 127.0.0.1 is in use"), line


def test_trtllm_deploy_says_how_ngram_is_served(tmp_path, capsys):
    import yaml

    from pipeline.cli import main

    data = yaml.safe_load(open("configs/llama3.1-8b_llama3.2-1b.yaml"))
    data["speculative"]["method"] = "ngram+draft"
    path = tmp_path / "hybrid.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["deploy", str(path), "--engines-dir", str(tmp_path / "engines")]) == 0
    assert "n-gram proposals on TensorRT-LLM run through the Python executor" in capsys.readouterr().out
    data["speculative"]["method"] = "ngram"
    data.pop("draft")
    path.write_text(yaml.safe_dump(data))
    assert main(["deploy", str(path), "--engines-dir", str(tmp_path / "engines")]) == 2
    assert "cannot be served by the tensorrtllm_backend layout" in capsys.readouterr().err


def test_deploy_and_serve_cli_for_trtllm(tmp_path):
    path = write_config(tmp_path, trtllm_config_dict("cli-tp4"))
    engines = tmp_path / "engines"
    done = run_cli("deploy", str(path), "--engines-dir", str(engines), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "deploy built" in done.stdout
    served = run_cli("serve", str(path), "--engines-dir", str(engines), timeout=120)
    assert served.returncode == 0, served.stderr
    assert "repository up to date" in served.stdout
    assert "python3 scripts/launch_triton_server.py --world_size 6" in served.stdout
    assert "not available here" in served.stdout


@pytest.mark.server
def test_serve_prints_endpoints_answers_and_stops_on_sigterm(built_engines, tmp_path):
    config_path, engines = built_engines
    data = yaml.safe_load(config_path.read_text())
    ports = dict(zip(("http_port", "grpc_port", "metrics_port"), free_ports(3)))
    data["serve"] = {"bind_address": "127.0.0.1"}  # the ports come from the flags, overriding 8000-8002
    config = tmp_path / config_path.name
    config.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([PY, "-m", "pipeline", "serve", str(config), "--engines-dir", str(engines),
                                "--ready-timeout", "400", "--http-port", str(ports["http_port"]),
                                "--grpc-port", str(ports["grpc_port"]), "--metrics-port", str(ports["metrics_port"])],
                               cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    output = []
    try:
        deadline = time.monotonic() + 420  # model load is ~20 s idle, minutes on a loaded 2-core box
        while not any(line.startswith("ready:") for line in output):
            try:
                output.append(lines.get(timeout=max(deadline - time.monotonic(), 0.1)))
            except queue.Empty:
                pytest.fail("serve printed no 'ready:' line in time; output so far:\n" + "".join(output))
            assert process.poll() is None, "".join(output)
        ready = next(line for line in output if line.startswith("ready:"))
        assert f"http://127.0.0.1:{ports['http_port']}" in ready and f"127.0.0.1:{ports['grpc_port']}" in ready
        assert f"http://127.0.0.1:{ports['metrics_port']}/metrics" in ready
        url = f"http://127.0.0.1:{ports['http_port']}/v2/models/speculative/generate"
        body = json.dumps({"text_input": "def f(x):", "max_tokens": 5}).encode()
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=JSON), timeout=60) as response:
            assert len(json.loads(response.read())["output_ids"]) == 5
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert process.wait(timeout=90) == 0, "".join(output)
        stopped_in = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert stopped_in < 9, stopped_in  # idle: nothing to drain (Triton's model unloading took 10-12 s)
    with pytest.raises(urllib.error.URLError):  # the server went down with the command
        urllib.request.urlopen(f"http://127.0.0.1:{ports['http_port']}/v2/health/live", timeout=5)
