"""Start and stop the ``tritonserver`` binary shipped in the nvidia-pytriton wheel on a model repository.

The Python backend runs each model in a stub process that links libpython dynamically. The wheel's stub is built
per Python minor version and resolves ``libpython3.X.so`` through the loader path, so the server gets this
interpreter's LIBDIR first on LD_LIBRARY_PATH and its bin/ first on PATH; otherwise the stub picks up a system
libpython (or none) and every Python model fails to load.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..checks import bind_address_problem
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


# Credentials the server and its model processes never need (engines are local files): a model process that
# could read them would hand them to anything that runs inside it.
SECRET_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_API_TOKEN", "HUGGINGFACE_TOKEN")
SECRET_ENV_SUFFIXES = ("_TOKEN", "_SECRET", "_PASSWORD", "_API_KEY", "_SECRET_ACCESS_KEY")
# Triton APIs that change the server rather than query or use it: log levels and files, tracing, shared-memory
# registration (a client could map host memory regions), loading and unloading models. Restricted to a header
# whose value is a random key only this process knows (it needs model-repository itself, to reload models).
RESTRICTED_APIS = "shared-memory,model-repository,trace,logging"
ADMIN_HEADER = "specpipe-admin-key"
SCRATCH_PREFIX = "specpipe-triton-"  # + "<pid of the serve process>-" + random


def server_env(dist: TritonDist, base: dict[str, str] | None = None) -> dict[str, str]:
    env = {key: value for key, value in (os.environ if base is None else base).items()
           if key not in SECRET_ENV and not key.upper().endswith(SECRET_ENV_SUFFIXES)}
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


def sweep_dead_scratch(folder: Path | None = None) -> None:
    """Delete scratch folders of servers whose owning process is gone (a `serve` killed with SIGKILL)."""
    from ..artifacts import pid_alive

    for leftover in Path(folder or tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        pid = leftover.name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def ports_in_use(endpoints: Endpoints) -> list[str]:
    """The configured ports something already listens on, as "serve.<field>: <port>" (empty: all free)."""
    taken = []
    family = socket.AF_INET6 if ":" in endpoints.host else socket.AF_INET
    for name, port in (("http_port", endpoints.http_port), ("grpc_port", endpoints.grpc_port),
                       ("metrics_port", endpoints.metrics_port)):
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers do not count
            try:
                probe.bind((endpoints.host, port))
            except OSError:
                taken.append(f"serve.{name}: {port}")
    return taken


@dataclass
class TritonServer:
    """One tritonserver process; use as a context manager or call start()/stop().

    Models load explicitly (every model of the repository at start), so reload_model() can restart one whose
    Python-backend process died; the admin APIs need a per-server random key (see RESTRICTED_APIS).
    """

    repository: Path
    endpoints: Endpoints
    log_path: Path | None = None  # None: a file in the backend scratch folder
    exit_timeout_s: int = 15
    _process: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _scratch: Path | None = field(default=None, init=False, repr=False)
    _admin_key: str = field(default_factory=lambda: secrets.token_urlsafe(24), init=False, repr=False)
    _shm_regions: set[str] = field(default_factory=set, init=False, repr=False)

    @property
    def models(self) -> list[str]:
        return sorted(p.parent.name for p in self.repository.glob("*/config.pbtxt"))

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def argv(self, backend_dir: Path) -> list[str]:
        e = self.endpoints
        restricted = f"{RESTRICTED_APIS}:{ADMIN_HEADER}={self._admin_key}"
        return [
            str(TritonDist.find().binary), f"--model-repository={self.repository}",
            f"--backend-directory={backend_dir}",
            f"--http-address={e.host}", f"--http-port={e.http_port}",
            f"--grpc-address={e.host}", f"--grpc-port={e.grpc_port}",
            f"--metrics-address={e.host}", f"--metrics-port={e.metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=false",
            "--disable-auto-complete-config", "--strict-readiness=true", "--exit-on-error=true",
            f"--exit-timeout-secs={self.exit_timeout_s}", "--log-verbose=0",
            "--model-control-mode=explicit", *(f"--load-model={name}" for name in self.models),
            f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}",
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
        if problem := bind_address_problem(self.endpoints.host):
            raise ServerError(problem)
        taken = ports_in_use(self.endpoints)
        if taken:
            raise ServerError(f"{', '.join(taken)} on {self.endpoints.host} is in use (another server, or a second "
                              f"`serve` of this config?); stop it or choose free ports in the config's serve "
                              f"section")
        dist = TritonDist.find()
        sweep_dead_scratch()
        self._scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
        backend_dir = self._backend_dir(dist, self._scratch)
        self.log_path = self.log_path or self._scratch / "tritonserver.log"
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
        """Until our process answers ready on the HTTP port and listens on all three ports itself: a server that
        is not ours (one holding a port since the check in start()) can answer the same URL."""
        from . import procfs

        e = self.endpoints
        url = f"http://{e.client_host()}:{e.http_port}/v2/health/ready"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise ServerError(f"tritonserver exited with code {self._process.returncode} before it was "
                                  f"ready (a port in use? a model that fails to load?); {self._log_name()}:\n"
                                  f"{self.log_tail()}")
            with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
                with urllib.request.urlopen(url, timeout=2) as response:
                    ours = {e.http_port, e.grpc_port, e.metrics_port} <= procfs.listening_ports(self._process.pid)
                    if response.status == 200 and ours:
                        self._remember_shm()
                        return
            time.sleep(0.5)
        raise ServerError(f"tritonserver not ready after {timeout_s:.0f}s (models still loading? raise the "
                          f"timeout); {self._log_name()}:\n{self.log_tail()}")

    def _remember_shm(self) -> None:
        from . import procfs

        self._shm_regions |= {stub.shm_region for stub in procfs.stubs(self._process.pid)}

    def reload_model(self, model: str, timeout_s: float) -> None:
        """Unload and load one model through Triton's model-control API: new Python-backend processes for it.

        Unload first: a load request for a loaded model whose files did not change is a no-op in Triton 2.51,
        which left the dead process in place (seen after a server restart)."""
        for action in ("unload", "load"):
            self._repository_call(model, action, timeout_s)
        self._remember_shm()

    def _repository_call(self, model: str, action: str, timeout_s: float) -> None:
        e = self.endpoints
        url = f"http://{e.client_host()}:{e.http_port}/v2/repository/models/{model}/{action}"
        request = urllib.request.Request(url, data=b"{}", method="POST", headers={ADMIN_HEADER: self._admin_key})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s):
                pass
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise ServerError(f"{action} of model {model} failed (HTTP {exc.code}: {detail}); "
                              f"{self._log_name()}:\n{self.log_tail()}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            raise ServerError(f"{action} of model {model} failed ({exc}); {self._log_name()}:\n"
                              f"{self.log_tail()}") from None

    def _log_name(self) -> str:
        scratch = self._scratch is not None and self.log_path.is_relative_to(self._scratch)
        return "last lines of its log" if scratch else f"log {self.log_path}"

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def wait(self, timeout_s: float | None = None) -> int | None:
        """Block until the server exits by itself (its exit code), or ``timeout_s`` passes (None)."""
        if self._process is None:
            return 0
        try:
            return self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the server and its model processes at once (its own process group); stop() then returns."""
        if self._process is not None and self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._process.pid, signal.SIGKILL)

    def stop(self) -> int | None:
        """SIGTERM (Triton drains in-flight requests up to exit_timeout_s), then SIGKILL if it hangs; the server's
        model processes, shared memory and scratch folder go with it."""
        process = self._process
        code = None
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=self.exit_timeout_s + 10)
                except subprocess.TimeoutExpired:
                    self.kill()
            process.wait()
            code = process.returncode
            # Stubs left by a crashed or killed server share its process group; their pid namesake is gone.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            from . import procfs

            for region in self._shm_regions:  # normally Triton removes them; not after SIGKILL
                with contextlib.suppress(OSError):
                    (procfs.SHM_DIR / region).unlink()
            self._process = None
        if self._scratch is not None:
            if self.log_path and self.log_path.is_relative_to(self._scratch):
                self.log_path = None  # the scratch log goes with the folder
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        return code

    def __enter__(self) -> TritonServer:
        return self.start() if self._process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
