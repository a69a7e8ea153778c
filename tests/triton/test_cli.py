"""pipeline/triton/cli.py: `python -m pipeline deploy` and `serve`.

`serve` starts tritonserver on the config's loopback ports, prints the endpoints, answers, and stops cleanly on SIGTERM;
under the failures the adversarial probe found (issue 12, items a, b, e, f, l, m) a dead model process is reloaded
(then, past the restart budget, serve exits non-zero), oversized prompts are refused cheaply, a port held by another
server is never taken for ours, a second signal never leaves tritonserver behind, the admin APIs are closed and secrets
stay out of the server's environment (real tritonserver on loopback, marked server). For trtllm configs `deploy` writes
the repository and `serve` says how to launch it.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
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
from tests.conftest import PY, REPO, run_cli, write_config
from tests.triton_helpers import Serve, _children, free_port, process_tree_rss, trtllm_config_dict


SECRET = "hf_reliabilitySECRET0123456789"


def _config(source: Path, folder: Path, **serve) -> Path:
    data = yaml.safe_load(source.read_text())
    data["serve"] = {"bind_address": "127.0.0.1", "http_port": free_port(), "grpc_port": free_port(),
                     "metrics_port": free_port(), **serve}
    path = folder / source.name
    path.write_text(yaml.safe_dump(data))
    return path


def _ports(config: Path) -> dict:
    return yaml.safe_load(config.read_text())["serve"]


def _post(url: str, body: bytes, timeout: float = 60, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _generate(port: int, text: str | bytes = "def f(x):", max_tokens=4, timeout: float = 60):
    text = text.decode() if isinstance(text, bytes) else text
    body = json.dumps({"text_input": text, "max_tokens": max_tokens}).encode()
    return _post(f"http://127.0.0.1:{port}/v2/models/speculative/generate", body, timeout)


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


@pytest.fixture(scope="module")
def serving(built_engines, tmp_path_factory):
    config_path, engines = built_engines
    folder = tmp_path_factory.mktemp("reliability-serve")
    config = _config(config_path, folder)
    serve = Serve(config, engines, "--max-restarts", "1", "--log-file", str(folder / "triton.log"),
                  env={"HF_TOKEN": SECRET, "HUGGING_FACE_HUB_TOKEN": SECRET})
    try:
        assert serve.wait_for(lambda line: line.startswith("ready:"), 420), serve.text()
        yield serve, config, engines
    finally:
        serve.close()


@pytest.mark.server
def test_admin_apis_are_restricted_and_inference_is_not(serving):
    serve, config, _ = serving
    http = _ports(config)["http_port"]
    base = f"http://127.0.0.1:{http}/v2"
    assert _post(f"{base}/logging", json.dumps({"log_verbose_level": 3}).encode())[0] == 403
    assert _post(f"{base}/repository/models/speculative/unload", b"{}")[0] == 403
    assert _post(f"{base}/trace/setting", json.dumps({"trace_level": ["TIMESTAMPS"]}).encode())[0] == 403
    assert _post(f"{base}/systemsharedmemory/region/x/register",
                 json.dumps({"key": "/x", "offset": 0, "byte_size": 8}).encode())[0] == 403
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{_ports(config)['grpc_port']}")
    with pytest.raises(InferenceServerException, match="restricted"):
        client.update_log_settings({"log_verbose_level": 3})
    with pytest.raises(InferenceServerException, match="restricted"):
        client.unload_model("speculative")
    assert client.is_model_ready("speculative")
    status, answer = _generate(http)
    assert status == 200 and len(answer["output_ids"]) == 4, answer


@pytest.mark.server
def test_secrets_are_not_in_the_server_environment(serving):
    serve, _, _ = serving
    triton = serve.triton_pid
    stubs = [pid for pids in _stubs(triton).values() for pid in pids]
    assert stubs
    assert SECRET.encode() in Path(f"/proc/{serve.process.pid}/environ").read_bytes()  # the test set it
    for pid in [triton, *stubs]:
        assert SECRET.encode() not in Path(f"/proc/{pid}/environ").read_bytes(), pid


@pytest.mark.server
def test_oversized_text_input_is_refused_cheaply(serving):
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
    with pytest.raises(InferenceServerException) as refused:  # 10 MB: 19-27 s of tokenizing before the fix
        client.infer("speculative", [text, max_tokens])
    refused_in = time.perf_counter() - start
    assert "text_input: 10485760 bytes is over the" in str(refused.value), refused.value
    assert "-byte limit" in str(refused.value), refused.value
    assert refused_in < 5, refused_in  # mostly the 10 MB upload and Triton's own copies
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
    second = Serve(config, engines)
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
    # Found while testing this issue: Triton 2.51 dies of SIGSEGV on any HTTP JSON body over about 4 MB (here 5 MB
    # of padding after a valid request); anyone who reaches the HTTP port can send one. serve restarts it.
    serve, config, _ = serving
    http = _ports(config)["http_port"]
    crashed = serve.triton_pid
    body = json.dumps({"text_input": "def", "max_tokens": 4}).encode() + b" " * 5_000_000
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        _post(f"http://127.0.0.1:{http}/v2/models/speculative/generate", body)
    assert serve.wait_for(lambda line: "tritonserver restarted" in line, 240), serve.text()
    assert serve.triton_pid != crashed and "signal 11" in serve.text()
    status, answer = _generate(http)
    assert status == 200 and len(answer["output_ids"]) == 4, answer


@pytest.mark.server
def test_dead_model_process_is_reloaded_then_serve_gives_up(serving):
    # Last in this module: it ends the module's server. serve runs with --max-restarts 1.
    serve, config, _ = serving
    http = _ports(config)["http_port"]
    triton = serve.triton_pid
    victim = _stubs(triton)["speculative_stream"][0]
    os.kill(victim, signal.SIGKILL)  # what the kernel's OOM killer does
    assert serve.wait_for(lambda line: "speculative_stream" in line and "reloaded" in line, 240), serve.text()
    assert victim not in _stubs(triton).get("speculative_stream", [])
    status, answer = _generate(http)
    assert status == 200 and len(answer["output_ids"]) == 4, (answer, serve.text())
    os.kill(_stubs(triton)["speculative_stream"][0], signal.SIGKILL)  # a second death: over the budget of 1
    assert serve.process.wait(timeout=120) != 0, serve.text()
    assert "speculative_stream" in serve.text() and "restart" in serve.text()
    with pytest.raises(urllib.error.URLError):  # reported not ready: nothing answers any more
        urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=5)
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
        serve.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        serve.process.send_signal(signal.SIGTERM)  # an impatient operator (or a supervisor's second signal)
        second_signal = time.monotonic()
        code = serve.process.wait(timeout=60)
        exited_after = time.monotonic() - second_signal
        gone = [pid for pid in [triton, *stubs] if not procfs.alive(pid)]  # exited (a zombie awaits its reaper)
    finally:
        serve.close()
    print(f"serve exited {exited_after:.2f} s after the second signal")
    assert code == 130, serve.text()
    # at once: a graceful stop (unloading the models) takes 5 s or more here, a kill well under one
    assert exited_after < 3, (exited_after, serve.text())
    assert gone == [triton, *stubs], serve.text()  # at the moment serve exited, nothing of the server was left
    assert not scratch[0].exists()
    for port in _ports(config).values():
        if isinstance(port, int):
            with socket.socket() as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind; TIME_WAIT is fine
                probe.bind(("127.0.0.1", port))  # nothing listens any more


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
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
    data["serve"] = {"bind_address": "127.0.0.1", **ports}
    config = tmp_path / config_path.name
    config.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([PY, "-m", "pipeline", "serve", str(config), "--engines-dir", str(engines),
                                "--ready-timeout", "400"],
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
        with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=60) as response:
            assert len(json.loads(response.read())["output_ids"]) == 5
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=90) == 0, "".join(output)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    with pytest.raises(urllib.error.URLError):  # the server went down with the command
        urllib.request.urlopen(f"http://127.0.0.1:{ports['http_port']}/v2/health/live", timeout=5)
