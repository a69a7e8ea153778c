"""`python -m pipeline serve CONFIG`: starts tritonserver on the config's loopback ports, prints the endpoints,
answers, and stops cleanly on SIGTERM (the same path as Ctrl-C)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
import yaml
from conftest import PY, REPO

from triton_helpers import free_port

pytestmark = pytest.mark.server


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
