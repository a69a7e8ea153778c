"""`python -m pipeline deploy CONFIG` and `python -m pipeline serve CONFIG`."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from ..errors import BackendUnavailable, PipelineError
from ..methods import Method


def add_triton_parsers(sub, common) -> None:
    p = sub.add_parser("deploy", help="engines -> Triton model repository in engines/<name>/triton/")
    common(p)
    p.add_argument("--force", action="store_true", help="rewrite even if up to date")
    p.add_argument("--tokenizer-dir", default=None,
                   help="trtllm backend: tokenizer folder or hub id for pre/postprocessing "
                        "(default: the tokenizer copy in the target engine folder)")
    p.set_defaults(func=cmd_deploy)

    p = sub.add_parser("serve", help="deploy if needed, then run tritonserver on the repository until Ctrl-C")
    common(p)
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for the models to load")
    p.add_argument("--log-file", type=Path, default=None,
                   help="server log (default: engines/<name>/triton-server.log)")
    p.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                   help="reloads of a model whose process died, per model within 10 minutes, before serve stops "
                        f"the server and exits 1 (default {DEFAULT_MAX_RESTARTS}; 0: exit at the first death)")
    p.add_argument("--openai", action="store_true",
                   help="also serve an OpenAI-compatible HTTP API (/v1/models, /v1/completions, /v1/chat/completions, "
                        "streaming as server-sent events) in front of the same models, on serve.bind_address "
                        "(torch backend)")
    p.add_argument("--openai-port", type=int, default=None,
                   help="port of the OpenAI-compatible API (default: the config's serve.openai_port, 8080)")
    p.set_defaults(func=cmd_serve)


def cmd_deploy(args) -> int:
    from ..config import load_config
    from .repository import deploy

    config = load_config(args.config)
    result = deploy(config, args.engines_dir, force=args.force, tokenizer_dir=args.tokenizer_dir)
    print(f"deploy {result.status}: {result.path} ({', '.join(result.manifest.get('models', []))})")
    if config.backend == "trtllm":
        print(f"launch in the TensorRT-LLM container with {result.path / 'launch.sh'} (see its README.md)")
        if config.speculative.method == Method.MEDUSA:
            print("note: speculative.method 'medusa': the tensorrt_llm model verifies the Medusa tree itself "
                  "(greedy only in TensorRT-LLM 1.1.0; sampled requests are not lossless there)")
        elif config.speculative.method != Method.DRAFT_MODEL:
            print(f"note: speculative.method {config.speculative.method.value!r}: on Triton the TensorRT-LLM layout "
                  f"drafts with the draft engine only (tensorrt_llm_bls); n-gram proposals on TensorRT-LLM run "
                  f"through the Python executor (`python -m pipeline run`)")
    return 0


# How `serve` treats a Python-backend model process that dies (the kernel's OOM killer, a crash in native code):
# Triton keeps answering "ready" while every request to that model fails, so serve watches the processes itself,
# reloads the model through Triton's model-control API, and gives up (stops the server, exits 1) when one model
# needed more than --max-restarts reloads within RESTART_WINDOW_S: a crash loop is for an operator to look at.
# tritonserver itself dying of a signal (a crash, the OOM killer) is restarted under the same budget.
DEFAULT_MAX_RESTARTS = 3
RESTART_WINDOW_S = 600.0
WATCH_INTERVAL_S = 1.0


def cmd_serve(args) -> int:
    from ..config import load_config
    from .repository import deploy
    from .server import Endpoints, TritonServer

    config = load_config(args.config)
    if args.openai_port is not None and not args.openai:
        raise PipelineError(f"--openai-port {args.openai_port}: only used with --openai; add --openai or drop it")
    if args.openai and config.backend == "trtllm":
        raise PipelineError("--openai: not for the trtllm backend: its repository runs in NVIDIA's TensorRT-LLM "
                            "Triton container, not beside this process; there, Triton's own OpenAI-compatible frontend "
                            "serves it (/opt/tritonserver/python/openai/openai_frontend/main.py --model-repository "
                            "<repository> --tokenizer <tokenizer>)")
    if config.backend == "torch":
        from ..stages import verify_engines

        verify_engines(config, args.engines_dir)  # damaged or edited engines are refused before Triton loads them
    openai_socket = _reserve_openai_port(config, args.openai_port) if args.openai else None
    result = deploy(config, args.engines_dir)
    print(f"repository {result.status}: {result.path}")
    if config.backend == "trtllm":
        print("The trtllm backend is served by the TensorRT-LLM Triton container (needs NVIDIA GPUs and the "
              "tensorrtllm backend, not available here). Run there:\n"
              f"  TRTLLM_TRITON_MODELS=<TensorRT-LLM>/triton_backend/all_models/inflight_batcher_llm "
              f"{result.path / 'launch.sh'}\n"
              f"  which runs: {result.manifest['launch_command']}")
        return 0
    s = config.serve
    endpoints = Endpoints(s.bind_address, s.http_port, s.grpc_port, s.metrics_port)
    log_file = args.log_file or result.path.parent / "triton-server.log"
    server = TritonServer(result.path, endpoints, log_path=log_file)
    openai = None
    signals = 0

    def on_signal(signum, frame):
        # The first Ctrl-C or SIGTERM stops the server gracefully (in-flight requests drain); a second one kills
        # it and its model processes at once, and serve exits only after they are gone (ports free).
        nonlocal signals
        signals += 1
        if signals == 1:
            raise KeyboardInterrupt
        print("second signal: killing tritonserver and its model processes now", file=sys.stderr, flush=True)
        if openai is not None:
            openai.kill()
        server.kill()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"starting tritonserver (log {log_file}) ...", flush=True)
        server.start(ready_timeout_s=args.ready_timeout)
        host = endpoints.client_host()
        print(f"ready: HTTP http://{host}:{s.http_port}  gRPC {host}:{s.grpc_port}  "
              f"metrics http://{host}:{s.metrics_port}/metrics", flush=True)
        print(f"  curl -s http://{host}:{s.http_port}/v2/models/speculative/generate "
              f"-d '{{\"text_input\": \"def fibonacci(n):\", \"max_tokens\": 32}}'", flush=True)
        if openai_socket is not None:
            openai = _start_openai(config, args.engines_dir, endpoints, openai_socket)
        print("Ctrl-C or SIGTERM stops it (a second one kills it at once).", flush=True)
        return _supervise(server, args.max_restarts, args.ready_timeout, log_file)
    except KeyboardInterrupt:
        print("stopping tritonserver ...", flush=True)
        if openai is not None:
            openai.stop()
        server.stop()
        return 130 if signals > 1 else 0
    finally:
        if openai is not None:
            openai.stop()
        elif openai_socket is not None:
            openai_socket.close()
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _reserve_openai_port(config, port: int | None):
    """The OpenAI endpoint's socket, bound before tritonserver starts: a port in use fails before anything runs."""
    try:
        from ..openai_api.server import reserve_port
    except ImportError as exc:
        raise BackendUnavailable(f"--openai: {exc.name} is not installed; run `pip install -e '.[serve]'` or "
                                 f"`make setup`") from None
    s = config.serve
    setting = "serve.openai_port" if port is None else "--openai-port"
    port = s.openai_port if port is None else port
    taken = {s.http_port: "serve.http_port", s.grpc_port: "serve.grpc_port", s.metrics_port: "serve.metrics_port"}
    if port in taken:
        raise PipelineError(f"{setting}: {port} is also {taken[port]}; choose another port for the OpenAI endpoint")
    return reserve_port(s.bind_address, port, setting)


def _start_openai(config, engines_dir: Path, endpoints, sock):
    """The OpenAI-compatible endpoint in front of the running Triton (gRPC); prints its URL and an example."""
    from ..engine_info import read_engine
    from ..layout import Layout
    from ..openai_api.protocol import ServedModel
    from ..openai_api.server import OpenAIServer
    from .request_inputs import max_prompt_bytes

    target = read_engine(Layout.for_config(config, engines_dir).root, "target")
    served = ServedModel(config.name, target.max_seq_len, target.max_input_len, max_prompt_bytes(target.max_input_len))
    openai = OpenAIServer(served, f"{endpoints.client_host()}:{endpoints.grpc_port}", sock).start()
    print(f"OpenAI-compatible: {openai.url}  (model {config.name!r}: /models, /completions, /chat/completions)",
          flush=True)
    print(f"  curl -s {openai.url}/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{config.name}\", \"prompt\": \"def fibonacci(n):\", \"max_tokens\": 32}}'",
          flush=True)
    print(f"  or: OpenAI(base_url=\"{openai.url}\", api_key=\"unused\").completions.create(model=\"{config.name}\", "
          f"prompt=\"def fibonacci(n):\")", flush=True)
    return openai


def _supervise(server, max_restarts: int, reload_timeout_s: float, log_file: Path) -> int:
    """Wait for the server to exit; reload a model whose Python-backend process died, within the budget."""
    from . import procfs

    restarts: dict[str, list[float]] = {}  # model name (or "tritonserver") -> when it was restarted

    def within_budget(what: str, cause: str) -> bool:
        now = time.monotonic()
        recent = [t for t in restarts.get(what, []) if now - t < RESTART_WINDOW_S]
        window = f"{RESTART_WINDOW_S / 60:.0f} min"
        if len(recent) >= max_restarts:
            print(f"error: {what}: {cause}, and it was already restarted {len(recent)} time(s) in the last {window} "
                  f"(--max-restarts {max_restarts}); stopping tritonserver, not ready. See {log_file} and the "
                  f"kernel log (out of memory?)", file=sys.stderr, flush=True)
            return False
        restarts[what] = [*recent, now]
        print(f"warning: {what}: {cause}; restarting it (restart {len(recent) + 1} of at most {max_restarts} in "
              f"{window})", file=sys.stderr, flush=True)
        return True

    known = {stub.pid: stub for stub in procfs.stubs(server.pid)}
    while True:
        code = server.wait(WATCH_INTERVAL_S)
        if code is not None and code >= 0:  # it stopped by itself: a configuration problem, not a crash
            print(f"tritonserver exited with code {code}; log {log_file}", file=sys.stderr)
            return 1 if code else 0
        if code is not None:  # killed by a signal: a crash (Triton 2.51 segfaults on JSON bodies over ~4 MB)
            if not within_budget("tritonserver", f"died of signal {-code}"):
                return 1
            server.stop()
            server.start(ready_timeout_s=reload_timeout_s)
            print("tritonserver restarted", file=sys.stderr, flush=True)
            known = {stub.pid: stub for stub in procfs.stubs(server.pid)}
            continue
        dead = [stub for pid, stub in known.items() if not procfs.alive(pid)]
        for model in sorted({stub.model for stub in dead}):
            pids = ", ".join(str(stub.pid) for stub in dead if stub.model == model)
            if not within_budget(f"model {model}", f"its Python-backend process {pids} died (killed, or out of "
                                                   f"memory?)"):
                return 1
            server.reload_model(model, reload_timeout_s)
            print(f"model {model} reloaded", file=sys.stderr, flush=True)
        if dead:
            known = {stub.pid: stub for stub in procfs.stubs(server.pid)}
