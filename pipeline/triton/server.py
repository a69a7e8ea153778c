"""Start and stop the ``tritonserver`` binary shipped in the nvidia-pytriton wheel on a model repository.

The Python backend runs each model in a stub process that links libpython dynamically. The wheel's stub is built
per Python minor version and resolves ``libpython3.X.so`` through the loader path, so the server gets this
interpreter's LIBDIR first on LD_LIBRARY_PATH and its bin/ first on PATH; otherwise the stub picks up a system
libpython (or none) and every Python model fails to load.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BackendUnavailable, PipelineError


class ServerError(PipelineError):
    """tritonserver did not start or did not become ready."""


@dataclass(frozen=True)
class Endpoints:
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int

    @property
    def http(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def client_host(self) -> str:
        """Where a local client connects: a wildcard bind address is reached through loopback."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host


@dataclass(frozen=True)
class TritonDist:
    """The files of the wheel's Triton distribution this server needs."""

    binary: Path
    python_backend: Path  # folder with libtriton_python.so and triton_python_backend_utils.py
    stub: Path  # triton_python_backend_stub built for this interpreter's Python version
    libs: Path  # the wheel's bundled shared libraries

    @classmethod
    def find(cls) -> TritonDist:
        try:
            import pytriton
        except ImportError:
            raise BackendUnavailable("serve: nvidia-pytriton is not installed (it ships the tritonserver binary); "
                                     "run `pip install -e '.[serve]'` or `make setup`") from None
        root = Path(pytriton.__file__).parent
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        dist = cls(root / "tritonserver" / "bin" / "tritonserver", root / "tritonserver" / "backends" / "python",
                   root / "tritonserver" / "python_backend_stubs" / version / "triton_python_backend_stub",
                   root.parent / "nvidia_pytriton.libs")
        for path in (dist.binary, dist.python_backend / "libtriton_python.so", dist.stub):
            if not path.exists():
                raise BackendUnavailable(f"serve: {path} not found; the nvidia-pytriton wheel lacks it for Python "
                                         f"{version} (reinstall nvidia-pytriton, or use Python 3.8-3.13)")
        return dist


def server_env(dist: TritonDist, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, str(dist.libs), env.get("LD_LIBRARY_PATH", ""))
                                             if p)
    env["PATH"] = os.pathsep.join(p for p in (str(Path(sys.executable).parent), env.get("PATH", "")) if p)
    # The stub imports `pipeline`; model.py also adds pipeline_root itself, this covers tokenizer subprocesses.
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _die_with_parent() -> None:
    # Linux: the server gets SIGTERM if its parent dies without stopping it (no orphaned servers). The kernel
    # ties this to the forking *thread*, so call start() from a thread that outlives the server (the main one).
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class TritonServer:
    """One tritonserver process; use as a context manager or call start()/stop()."""

    repository: Path
    endpoints: Endpoints
    log_path: Path | None = None  # None: a file in the backend scratch folder
    exit_timeout_s: int = 15
    _process: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _scratch: tempfile.TemporaryDirectory | None = field(default=None, init=False, repr=False)

    def argv(self, backend_dir: Path) -> list[str]:
        e = self.endpoints
        return [
            str(TritonDist.find().binary), f"--model-repository={self.repository}",
            f"--backend-directory={backend_dir}",
            f"--http-address={e.host}", f"--http-port={e.http_port}",
            f"--grpc-address={e.host}", f"--grpc-port={e.grpc_port}",
            f"--metrics-address={e.host}", f"--metrics-port={e.metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=false",
            "--disable-auto-complete-config", "--strict-readiness=true", "--exit-on-error=true",
            f"--exit-timeout-secs={self.exit_timeout_s}", "--log-verbose=0",
        ]

    def _backend_dir(self, dist: TritonDist, scratch: Path) -> Path:
        """A backend folder holding the python backend plus the stub for this Python version (links only)."""
        python = scratch / "backends" / "python"
        python.mkdir(parents=True)
        for source in (dist.python_backend / "libtriton_python.so",
                       dist.python_backend / "triton_python_backend_utils.py", dist.stub):
            (python / source.name).symlink_to(source)
        return python.parent

    def start(self, ready_timeout_s: float = 180.0) -> TritonServer:
        if self._process is not None:
            raise ServerError("tritonserver already started by this object; stop() it first")
        dist = TritonDist.find()
        self._scratch = tempfile.TemporaryDirectory(prefix="specpipe-triton-")
        scratch = Path(self._scratch.name)
        backend_dir = self._backend_dir(dist, scratch)
        self.log_path = self.log_path or scratch / "tritonserver.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(self.argv(backend_dir), env=server_env(dist), stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True, preexec_fn=_die_with_parent)
        try:
            self.wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float) -> None:
        url = f"http://{self.endpoints.client_host()}:{self.endpoints.http_port}/v2/health/ready"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise ServerError(f"tritonserver exited with code {self._process.returncode} before it was "
                                  f"ready (a port in use? a model that fails to load?); {self._log_name()}:\n"
                                  f"{self.log_tail()}")
            with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            time.sleep(0.5)
        raise ServerError(f"tritonserver not ready after {timeout_s:.0f}s (models still loading? raise the "
                          f"timeout); {self._log_name()}:\n{self.log_tail()}")

    def _log_name(self) -> str:
        scratch = self._scratch is not None and self.log_path.is_relative_to(Path(self._scratch.name))
        return "last lines of its log" if scratch else f"log {self.log_path}"

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def wait(self) -> int:
        """Block until the server exits by itself; returns its exit code."""
        return self._process.wait() if self._process else 0

    def stop(self) -> int | None:
        """SIGTERM (Triton drains in-flight requests up to exit_timeout_s), then SIGKILL if it hangs."""
        process, self._process = self._process, None
        code = None
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=self.exit_timeout_s + 10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            code = process.returncode
        if self._scratch is not None:
            if self.log_path and self.log_path.is_relative_to(Path(self._scratch.name)):
                self.log_path = None  # the scratch log goes with the folder
            self._scratch.cleanup()
            self._scratch = None
        return code

    def __enter__(self) -> TritonServer:
        return self.start() if self._process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
