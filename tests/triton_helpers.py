"""Helpers for tests that run the real tritonserver: start one on loopback, and measure its memory."""

from __future__ import annotations

import importlib.util
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from pipeline.config import load_config
from pipeline.triton.repository import deploy
from pipeline.triton.server import Endpoints, TritonServer

REPO = Path(__file__).resolve().parents[1]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (a race with other processes is possible but rare)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports nothing listens on right now: all bound at once, so the system cannot hand one out
    twice (free_port called twice in a row can return the same port)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def start_server(config_path: Path, engines: Path, log_path: Path) -> TritonServer:
    """Deploy the engines and start tritonserver on free loopback ports; the caller stops it."""
    repo = deploy(load_config(config_path), engines).path
    endpoints = Endpoints("127.0.0.1", *free_ports(3))
    return TritonServer(repo, endpoints, log_path=log_path).start(ready_timeout_s=400)  # slow on a busy 2-core box


def server_pid(server: TritonServer) -> int:
    assert server.running, "tritonserver is not running"
    return server._process.pid  # noqa: SLF001 - TritonServer exposes no pid; the test needs it for /proc


def _children(pid: int) -> list[int]:
    kids = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids += [int(p) for p in children.read_text().split()]
        except OSError:  # the thread exited while we read
            continue
    return kids


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except OSError:  # the process exited
        pass
    return 0


def process_tree_rss(pid: int) -> dict[int, int]:
    """RSS in bytes of ``pid`` and all its descendants (tritonserver + its Python-backend stubs), by pid."""
    rss, todo = {}, [pid]
    while todo:
        current = todo.pop()
        if current in rss:
            continue
        rss[current] = _rss_bytes(current)
        todo += _children(current)
    return rss


def load_script(name: str):
    """Import scripts/<name>.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def trtllm_config_dict(name: str = "big-tp4") -> dict:
    return {
        "name": name, "backend": "trtllm",
        # dtype written: auto would read each model's config.json, which this offline test has no copy of
        "target": {"model": "meta-llama/Llama-3.3-70B-Instruct", "dtype": "bfloat16"},
        "draft": {"model": "meta-llama/Llama-3.2-1B-Instruct", "dtype": "bfloat16"},
        "speculative": {"max_draft_len": 5, "acceptance": "rejection"},
        "build": {"max_batch_size": 8, "max_input_len": 4096, "max_seq_len": 8192, "parallel": {"tp": 4, "pp": 1},
                  "kv_cache": {"free_gpu_mem_fraction": 0.85}},
        "runtime": {"target_device_ids": [0, 1, 2, 3], "draft_device_ids": [0]},
        "serve": {"http_port": 9000, "grpc_port": 9001, "metrics_port": 9002, "max_queue_delay_us": 100},
    }


class Serve:
    """One `python -m pipeline serve` subprocess and the lines it printed (``extra``: more serve flags)."""

    def __init__(self, config: Path, engines: Path, *extra: str, env: dict | None = None):
        from tests.conftest import PY, REPO

        self.config = config
        full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        self.process = subprocess.Popen([PY, "-m", "pipeline", "serve", str(config), "--engines-dir", str(engines),
                                         "--ready-timeout", "400", *extra], cwd=REPO, env=full_env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.process.stdout],
                         daemon=True).start()

    def wait_for(self, predicate, timeout: float) -> str | None:
        """The first printed line (old or new) for which predicate holds, or None when serve exits or time is up."""
        for line in self.output:
            if predicate(line):
                return line
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.process.poll() is not None and self.lines.empty():
                    return None
                continue
            self.output.append(line)
            if predicate(line):
                return line
        return None

    def text(self) -> str:
        while not self.lines.empty():
            self.output.append(self.lines.get())
        return "".join(self.output)

    @property
    def triton_pid(self) -> int:
        kids = [pid for pid in _children(self.process.pid)
                if Path(f"/proc/{pid}/exe").resolve().name == "tritonserver"]
        assert len(kids) == 1, kids
        return kids[0]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
