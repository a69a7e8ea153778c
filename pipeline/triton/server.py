"""Start and stop the ``tritonserver`` binary shipped in the nvidia-pytriton wheel on a model repository.

The Python backend runs each model in a stub process that links libpython dynamically. The wheel's stub is built
per Python minor version and resolves ``libpython3.X.so`` through the loader path, so the server gets this
interpreter's LIBDIR first on LD_LIBRARY_PATH and its bin/ first on PATH; otherwise the stub picks up a system
libpython (or none) and every Python model fails to load.
"""

from __future__ import annotations

import contextlib
import os
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
    """Where tritonserver listens: every listener on ``host``, unless ``http_host`` / ``grpc_host`` name another
    address for that one (serve keeps Triton's HTTP on loopback behind its own HTTP front)."""

    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    http_host: str = ""
    grpc_host: str = ""

    @property
    def http(self) -> str:
        return f"{_client_host(self.http_host or self.host)}:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"{_client_host(self.grpc_host or self.host)}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{_client_host(self.host)}:{self.metrics_port}/metrics"

    def listeners(self) -> list[tuple[str, str, int]]:
        """(setting, address, port) of each listener."""
        return [("http_port", self.http_host or self.host, self.http_port),
                ("grpc_port", self.grpc_host or self.host, self.grpc_port),
                ("metrics_port", self.host, self.metrics_port)]


def _client_host(host: str) -> str:
    """Where a local client connects: a wildcard bind address is reached through loopback."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else f"[{host}]" if ":" in host else host


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


# What tritonserver and its model processes inherit of this process's environment: an allow-list, because a
# model process that could read a credential (HF_TOKEN, a cloud key, the API key serve checks) would hand it to
# anything that runs inside it, and credentials are named too freely for a deny-list to catch them.
ENV_ALLOWED = frozenset({"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
                         "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "VIRTUAL_ENV",
                         "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TRANSFORMERS_CACHE",
                         "TOKENIZERS_PARALLELISM", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",
                         "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "OMP_NUM_THREADS",
                         "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "KMP_AFFINITY", "KMP_BLOCKTIME",
                         "SPECPIPE_CACHE"})  # where compiled packages are kept (runtime.torch_compile)
ENV_ALLOWED_PREFIXES = ("LC_", "TORCHINDUCTOR_", "TORCH_", "PYTORCH_", "XDG_")
# Triton APIs that change the server rather than query or use it: log levels and files, tracing, shared-memory
# registration (a client could have Triton read or write a region of another process), the model repository
# (loading a model is running its code). They are refused to every client: the key Triton checks is a header name
# holding a colon, which neither an HTTP/1.1 request (the name ends at the first colon) nor gRPC metadata (names
# with a colon are reserved pseudo-headers) can carry. Triton takes its restriction keys only on its command line,
# where every local user can read them, so a key anyone could send would be a key everyone has. serve itself needs
# none of these APIs: the repository loads once at start (model control off) and a model process that dies is
# recovered by restarting tritonserver.
RESTRICTED_APIS = "shared-memory,model-repository,trace,logging"
UNSENDABLE_HEADER = "specpipe:closed"
# The APIs a client of the internal HTTP port uses; that port answers only requests whose Host header names it
# exactly, as serve's HTTP front sends them, so a web page that rebinds a name of its own to 127.0.0.1 is refused.
HOST_CHECKED_APIS = "health,metadata,inference,model-config,statistics"
# What Triton 2.51 logs after SIGTERM once every model is idle (server.cc, before it unloads them).
DRAINED_LOG_LINE = "All models are stopped, unloading models"
SCRATCH_PREFIX = "specpipe-triton-"  # + "<pid of the serve process>-" + random


def server_env(dist: TritonDist, base: dict[str, str] | None = None) -> dict[str, str]:
    env = {key: value for key, value in (os.environ if base is None else base).items()
           if key in ENV_ALLOWED or key.startswith(ENV_ALLOWED_PREFIXES)}
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, str(dist.libs), env.get("LD_LIBRARY_PATH", ""))
                                             if p)
    env["PATH"] = os.pathsep.join(p for p in (str(Path(sys.executable).parent), env.get("PATH", "")) if p)
    # The stub imports `pipeline`; model.py also adds pipeline_root itself, this covers tokenizer subprocesses.
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _start_server_process() -> None:
    """In the forked child before exec: files and shared memory it creates are its user's alone (the Python
    backend's shared-memory regions carry every request's tensors), and it dies with serve."""
    os.umask(0o077)
    _die_with_parent()


def _die_with_parent() -> None:
    # Linux: the server gets SIGTERM if its parent dies without stopping it (no orphaned servers). The kernel
    # ties this to the forking *thread*, so call start() from a thread that outlives the server (the main one).
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def sweep_dead_scratch(folder: Path | None = None) -> None:
    """Delete scratch folders of servers whose owning process is gone (a `serve` killed with SIGKILL), and kill
    model processes still running from one: a tritonserver that got its parent-death SIGTERM while a model process
    was stuck exits without it, and the orphan would hold its memory (and its model's shared memory) for good."""
    from ..artifacts import pid_alive
    from . import procfs

    for leftover in Path(folder or tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        pid = leftover.name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            for orphan in procfs.running_from(leftover):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(orphan, signal.SIGKILL)
            shutil.rmtree(leftover, ignore_errors=True)


def ports_in_use(endpoints: Endpoints) -> list[str]:
    """The configured ports something already listens on, as "serve.<field>: <port>" (empty: all free)."""
    taken = []
    for name, host, port in endpoints.listeners():
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers do not count
            try:
                probe.bind((host, port))
            except OSError:
                taken.append(f"serve.{name}: {port} on {host}")
    return taken


@dataclass
class TritonServer:
    """One tritonserver process; use as a context manager or call start()/stop().

    Every model of the repository loads at start and nothing loads after (model control off); the admin APIs are
    closed to every client (see RESTRICTED_APIS). ``http_host_check``: the HTTP port answers only requests whose
    Host header is exactly ``endpoints.http`` (serve's HTTP front in front of it sends that).
    """

    repository: Path
    endpoints: Endpoints
    log_path: Path | None = None  # None: a file in the backend scratch folder
    exit_timeout_s: int = 15
    http_host_check: bool = False
    _process: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _scratch: Path | None = field(default=None, init=False, repr=False)
    _shm_regions: set[str] = field(default_factory=set, init=False, repr=False)

    @property
    def models(self) -> list[str]:
        return sorted(p.parent.name for p in self.repository.glob("*/config.pbtxt"))

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def argv(self, backend_dir: Path) -> list[str]:
        e = self.endpoints
        closed = f"{RESTRICTED_APIS}:{UNSENDABLE_HEADER}=refused"
        host_checked = [f"--http-restricted-api={HOST_CHECKED_APIS}:host={e.http}"] if self.http_host_check else []
        return [
            str(TritonDist.find().binary), f"--model-repository={self.repository}",
            f"--backend-directory={backend_dir}",
            f"--http-address={e.http_host or e.host}", f"--http-port={e.http_port}",
            f"--grpc-address={e.grpc_host or e.host}", f"--grpc-port={e.grpc_port}",
            f"--metrics-address={e.host}", f"--metrics-port={e.metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=false",
            "--disable-auto-complete-config", "--strict-readiness=true", "--exit-on-error=true",
            f"--exit-timeout-secs={self.exit_timeout_s}", "--log-verbose=0", "--model-control-mode=none",
            f"--http-restricted-api={closed}", f"--grpc-restricted-protocol={closed}", *host_checked,
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
        for _, host, _ in self.endpoints.listeners():
            if problem := bind_address_problem(host):
                raise ServerError(problem)
        taken = ports_in_use(self.endpoints)
        if taken:
            raise ServerError(f"{', '.join(taken)} is in use (another server, or a second `serve` of this config?); "
                              f"stop it or choose free ports in the config's serve section")
        dist = TritonDist.find()
        sweep_dead_scratch()
        self._scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
        backend_dir = self._backend_dir(dist, self._scratch)
        self.log_path = self.log_path or self._scratch / "tritonserver.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(self.argv(backend_dir), env=server_env(dist), stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True, preexec_fn=_start_server_process)
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
        url = f"http://{e.http}/v2/health/ready"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise ServerError(f"tritonserver exited with code {self._process.returncode} before it was "
                                  f"ready (a port in use? a model that fails to load?); {self._log_name()}:\n"
                                  f"{self.log_tail()}")
            with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
                with urllib.request.urlopen(url, timeout=2) as response:
                    ours = {port for _, _, port in e.listeners()} <= procfs.listening_ports(self._process.pid)
                    if response.status == 200 and ours:
                        self._remember_shm()
                        return
            time.sleep(0.5)
        raise ServerError(f"tritonserver not ready after {timeout_s:.0f}s (models still loading? raise the "
                          f"timeout); {self._log_name()}:\n{self.log_tail()}")

    def _remember_shm(self) -> None:
        """Note the model processes' shared-memory regions (removed by stop() even after a kill) and make them the
        user's alone: the Python backend creates them mode 0644 whatever the umask, and every request's tensors
        pass through them. (Between a region's creation at model load and this call, before any request was
        served, another local user could open it; a private /dev/shm, e.g. a container, closes that window.)"""
        from . import procfs

        for stub in procfs.stubs(self._process.pid):
            self._shm_regions.add(stub.shm_region)
            with contextlib.suppress(OSError):
                os.chmod(procfs.SHM_DIR / stub.shm_region.lstrip("/"), 0o600)

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

    def stop(self, graceful: bool = True) -> int | None:
        """SIGTERM (Triton drains in-flight requests up to exit_timeout_s), then SIGKILL if it hangs; the server's
        model processes, shared memory and scratch folder go with it. ``graceful=False`` kills at once: after a
        model process died, Triton would wait out exit_timeout_s for requests that process will never answer."""
        process = self._process
        code = None
        if process is not None:
            if not graceful:
                self.kill()
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                self._wait_for_drain(process)
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

    def _wait_for_drain(self, process: subprocess.Popen) -> None:
        """After SIGTERM: Triton lets in-flight requests finish (up to exit_timeout_s), then unloads each model
        instance, the Python backend spending a second per instance on a health check; once the log says no
        inference is in flight there is nothing left to lose, so the rest is a kill, not a wait."""
        start = self.log_path.stat().st_size if self.log_path and self.log_path.exists() else 0
        deadline = time.monotonic() + self.exit_timeout_s + 10
        while time.monotonic() < deadline:
            try:
                process.wait(timeout=0.2)
                return
            except subprocess.TimeoutExpired:
                pass
            if DRAINED_LOG_LINE in self._log_since(start):
                break
        self.kill()

    def _log_since(self, offset: int) -> str:
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(offset)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> TritonServer:
        return self.start() if self._process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
