"""`python -m pipeline deploy CONFIG` and `python -m pipeline serve CONFIG`."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from ..errors import PipelineError
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
    p.add_argument("--ready-timeout", type=float, default=None,
                   help="seconds to wait for the models to load (default 300; 1800 with runtime.torch_compile, "
                        "whose first start compiles the buckets)")
    p.add_argument("--log-file", type=Path, default=None,
                   help="server log (default: engines/<name>/triton-server.log)")
    p.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                   help="restarts of tritonserver after it or one of its model processes died, within 10 minutes, "
                        f"before serve exits 1 (default {DEFAULT_MAX_RESTARTS}; 0: exit at the first death)")
    p.add_argument("--openai", action="store_true",
                   help="also serve an OpenAI-compatible HTTP API (/v1/models, /v1/completions, /v1/chat/completions, "
                        "streaming as server-sent events) in front of the same models, on serve.bind_address "
                        "(torch backend)")
    p.add_argument("--openai-port", type=_port, default=None,
                   help="port of the OpenAI-compatible API (default: the config's serve.openai_port, 8080)")
    for flag, key in PORT_FLAGS:
        p.add_argument(flag, type=_port, default=None, dest=key,
                       help=f"port of {PORT_WHAT[key]} (default: the config's serve.{key})")
    p.add_argument("--api-key-file", type=Path, default=None,
                   help="file (mode 600) whose first line is the API key every endpoint then requires as "
                        "`Authorization: Bearer <key>`; instead of serve.api_key_env. Never pass a key itself on "
                        "the command line: every local user can read it there")
    p.set_defaults(func=cmd_serve)


# serve's port flags and the serve.<key> each overrides (--openai-port, which needs --openai, is declared beside it).
PORT_FLAGS = [("--http-port", "http_port"), ("--grpc-port", "grpc_port"), ("--metrics-port", "metrics_port")]
PORT_WHAT = {"http_port": "Triton's HTTP API", "grpc_port": "Triton's gRPC API",
             "metrics_port": "Triton's Prometheus metrics"}


def _port(text: str) -> int:
    """An argparse type: a TCP port number (argparse prefixes the flag to the message)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number; give an integer from 1 to 65535") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number; give an integer from 1 to 65535")
    return port


def with_port_flags(config, args):
    """The config with serve's port flags applied to its serve section, checked as the config's own ports are
    (all four distinct); errors name the flag. The rest of serve reads the ports from config.serve."""
    from ..config import ServeSpec

    flags = {key: (flag, getattr(args, key)) for flag, key in PORT_FLAGS if getattr(args, key) is not None}
    if args.openai_port is not None:
        flags["openai_port"] = ("--openai-port", args.openai_port)
    if not flags:
        return config
    if config.backend == "trtllm":
        names = ", ".join(flag for flag, _ in flags.values())
        raise PipelineError(f"{names}: not for the trtllm backend: serve only prints the launch command of the "
                            f"repository, whose ports deploy takes from the config; set serve.http_port / grpc_port "
                            f"/ metrics_port there and run `python -m pipeline deploy CONFIG --force`")
    ports = {key: getattr(config.serve, key) for key in ("http_port", "grpc_port", "metrics_port", "openai_port")}
    ports.update({key: value for key, (_, value) in flags.items()})
    for key, (flag, value) in flags.items():
        for other, other_value in ports.items():
            if other != key and other_value == value:
                clash = flags[other][0] if other in flags else f"serve.{other}"
                raise PipelineError(f"{flag}: {value} is also {clash}; serve's HTTP, gRPC, metrics and OpenAI ports "
                                    f"must differ, choose another port")
    serve = ServeSpec.model_validate({**config.serve.model_dump(), **ports})
    return config.model_copy(update={"serve": serve})


def _name_port_flags(message: str, args) -> str:
    for flag, key in [*PORT_FLAGS, ("--openai-port", "openai_port")]:
        if getattr(args, key) is not None:
            message = message.replace(f"serve.{key}: ", f"{flag}: ")
    return message


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
# Triton keeps answering "ready" while every request to that model hangs, and with model control off (no code can be
# loaded into a running server) the way back is a new tritonserver. So serve watches the processes itself, kills the
# whole server at once (its clients get an error now instead of waiting forever) and starts it again, and gives up
# (exits 1) after more than --max-restarts restarts within RESTART_WINDOW_S: a crash loop is for an operator.
DEFAULT_MAX_RESTARTS = 3
RESTART_WINDOW_S = 600.0
WATCH_INTERVAL_S = 1.0


def cmd_serve(args) -> int:
    from ..config import load_config
    from .repository import deploy

    config = load_config(args.config)
    _check_serve_args(args, config)
    config = with_port_flags(config, args)
    if args.ready_timeout is None:
        compiles = config.backend == "torch" and config.runtime.torch_compile
        args.ready_timeout = 1800.0 if compiles else 300.0
    fronts = None
    if config.backend == "torch":
        from ..stages import verify_engines
        from .fronts import Fronts, load_api_key

        verify_engines(config, args.engines_dir)  # damaged or edited engines are refused before Triton loads them
        openai_port = config.serve.openai_port if args.openai else None
        # Ports first: one in use fails before anything is deployed or started.
        try:
            fronts = Fronts(config, load_api_key(config, args.api_key_file), openai_port).reserve()
        except PipelineError as exc:  # a port in use: name the flag that chose it, not the config key it overrode
            raise PipelineError(_name_port_flags(str(exc), args)) from None
    try:
        result = deploy(config, args.engines_dir)
    except BaseException:
        if fronts is not None:
            fronts.close()
        raise
    print(f"repository {result.status}: {result.path}")
    if fronts is None:
        _print_trtllm_launch(result)
        return 0
    log_file = args.log_file or result.path.parent / "triton-server.log"
    return _serve(fronts, result.path, log_file, args)


def _check_serve_args(args, config) -> None:
    if args.openai_port is not None and not args.openai:
        raise PipelineError(f"--openai-port {args.openai_port}: only used with --openai; add --openai or drop it")
    if config.backend == "trtllm" and args.openai:
        raise PipelineError("--openai: not for the trtllm backend: its repository runs in NVIDIA's TensorRT-LLM "
                            "Triton container, not beside this process; there, Triton's own OpenAI-compatible frontend "
                            "serves it (/opt/tritonserver/python/openai/openai_frontend/main.py --model-repository "
                            "<repository> --tokenizer <tokenizer>)")
    if config.backend == "trtllm" and args.api_key_file is not None:
        raise PipelineError("--api-key-file: not for the trtllm backend: serve only prints the launch command there; "
                            "put the TensorRT-LLM container behind a proxy that checks keys")


def _print_trtllm_launch(result) -> None:
    print("The trtllm backend is served by the TensorRT-LLM Triton container (needs NVIDIA GPUs and the "
          "tensorrtllm backend, not available here). Run there:\n"
          f"  TRTLLM_TRITON_MODELS=<TensorRT-LLM>/triton_backend/all_models/inflight_batcher_llm "
          f"{result.path / 'launch.sh'}\n"
          f"  which runs: {result.manifest['launch_command']}")


def _serve(fronts, repository: Path, log_file: Path, args) -> int:
    """tritonserver on loopback behind the fronts, until a signal: the first drains (in-flight requests finish
    within serve.drain_timeout_s, the rest end with an error), a second kills everything at once."""
    from .server import TritonServer

    s = fronts.config.serve
    server = TritonServer(repository, fronts.triton_endpoints, log_path=log_file, exit_timeout_s=s.drain_timeout_s,
                          http_host_check=True)
    signals = 0

    def on_signal(signum, frame):
        nonlocal signals
        signals += 1
        if signals == 1:
            raise KeyboardInterrupt
        print("second signal: killing tritonserver and its model processes now", file=sys.stderr, flush=True)
        fronts.kill()
        server.kill()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"starting tritonserver (log {log_file}) ...", flush=True)
        server.start(ready_timeout_s=args.ready_timeout)
        lines = fronts.start(args.engines_dir)
        print("ready: " + "  ".join(lines[:3]), flush=True)
        for line in lines[3:]:
            print(line, flush=True)
        key = " -H 'Authorization: Bearer <key>'" if fronts.api_key else ""
        print(f"  curl -s {lines[0].split()[1]}/v2/models/speculative/generate{key} -H 'Content-Type: application/json' "
              f"-d '{{\"text_input\": \"def fibonacci(n):\", \"max_tokens\": 32}}'", flush=True)
        print("Ctrl-C or SIGTERM stops it (a second one kills it at once).", flush=True)
        return _supervise(server, args.max_restarts, args.ready_timeout, log_file)
    except KeyboardInterrupt:
        print(f"stopping: in-flight requests get {s.drain_timeout_s} s ...", flush=True)
        fronts.drain(s.drain_timeout_s)  # every client request passes a front: then nothing is in flight
        server.stop()
        return 130 if signals > 1 else 0
    finally:
        fronts.kill()
        fronts.close()
        server.stop(graceful=False)
        for sig, handler in previous.items():
            # Stopping because of a signal: a late one (a supervisor that sends two) must not kill the process
            # with everything already cleaned up and the exit code about to be returned.
            signal.signal(sig, handler if not signals else signal.SIG_IGN)


def _supervise(server, max_restarts: int, ready_timeout_s: float, log_file: Path) -> int:
    """Wait for the server to exit; restart it when it or one of its model processes died, within the budget."""
    from . import procfs

    restarts: list[float] = []
    known = procfs.stubs(server.pid)
    while True:
        code = server.wait(WATCH_INTERVAL_S)
        if code is not None and code >= 0:  # it stopped by itself: a configuration problem, not a crash
            print(f"tritonserver exited with code {code}; log {log_file}", file=sys.stderr)
            return 1 if code else 0
        if code is not None:  # killed by a signal: a crash (Triton 2.51 segfaults on JSON bodies over ~4 MB)
            cause = f"tritonserver died of signal {-code}"
        else:
            dead = [stub for stub in known if not procfs.alive(stub.pid)]
            if not dead:
                continue
            cause = ", ".join(f"the Python-backend process {stub.pid} of model {stub.model}" for stub in dead) + \
                " died (killed, or out of memory?)"
        now = time.monotonic()
        restarts = [t for t in restarts if now - t < RESTART_WINDOW_S]
        window = f"{RESTART_WINDOW_S / 60:.0f} min"
        server.stop(graceful=False)  # in-flight requests fail now: the dead process would never answer them
        if len(restarts) >= max_restarts:
            print(f"error: {cause}, and tritonserver was already restarted {len(restarts)} time(s) in the last "
                  f"{window} (--max-restarts {max_restarts}); stopped, not ready. See {log_file} and the kernel log "
                  f"(out of memory?)", file=sys.stderr, flush=True)
            return 1
        restarts.append(now)
        print(f"warning: {cause}; restarting tritonserver (restart {len(restarts)} of at most {max_restarts} in "
              f"{window})", file=sys.stderr, flush=True)
        server.start(ready_timeout_s=ready_timeout_s)
        print("tritonserver restarted", file=sys.stderr, flush=True)
        known = procfs.stubs(server.pid)
