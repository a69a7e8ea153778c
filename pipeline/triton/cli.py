"""`python -m pipeline deploy CONFIG` and `python -m pipeline serve CONFIG`."""

from __future__ import annotations

import signal
import sys
from pathlib import Path


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
    p.set_defaults(func=cmd_serve)


def cmd_deploy(args) -> int:
    from ..config import load_config
    from .repository import deploy

    config = load_config(args.config)
    result = deploy(config, args.engines_dir, force=args.force, tokenizer_dir=args.tokenizer_dir)
    print(f"deploy {result.status}: {result.path} ({', '.join(result.manifest.get('models', []))})")
    if config.backend == "trtllm":
        print(f"launch in the TensorRT-LLM container with {result.path / 'launch.sh'} (see its README.md)")
        if config.speculative.method != "draft_model":
            print(f"note: speculative.method {config.speculative.method!r}: on Triton the TensorRT-LLM layout "
                  f"drafts with the draft engine only (tensorrt_llm_bls); n-gram proposals on TensorRT-LLM run "
                  f"through the Python executor (`python -m pipeline run`)")
    return 0


def cmd_serve(args) -> int:
    from ..config import load_config
    from .repository import deploy
    from .server import Endpoints, TritonServer

    config = load_config(args.config)
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

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt  # one shutdown path for Ctrl-C and SIGTERM

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        print(f"starting tritonserver (log {log_file}) ...", flush=True)
        server.start(ready_timeout_s=args.ready_timeout)
        host = endpoints.client_host()
        print(f"ready: HTTP http://{host}:{s.http_port}  gRPC {host}:{s.grpc_port}  "
              f"metrics http://{host}:{s.metrics_port}/metrics", flush=True)
        print(f"  curl -s http://{host}:{s.http_port}/v2/models/speculative/generate "
              f"-d '{{\"text_input\": \"def fibonacci(n):\", \"max_tokens\": 32}}'", flush=True)
        print("Ctrl-C or SIGTERM stops it.", flush=True)
        code = server.wait()
        print(f"tritonserver exited with code {code}; log {log_file}", file=sys.stderr)
        return 1 if code else 0
    except KeyboardInterrupt:
        print("stopping tritonserver ...", flush=True)
        return 0
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)
