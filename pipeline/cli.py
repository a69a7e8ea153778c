"""`python -m pipeline STAGE CONFIG [options]`: one subcommand per stage.

User errors (PipelineError) print one line and exit 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .errors import PipelineError

DEFAULT_ENGINES = Path(os.environ.get("PIPELINE_ENGINES_DIR", "engines"))


def _common(parser: argparse.ArgumentParser, config: bool = True) -> None:
    if config:
        parser.add_argument("config", type=Path, help="pipeline YAML, e.g. configs/tiny.yaml")
    parser.add_argument("--engines-dir", type=Path, default=DEFAULT_ENGINES,
                        help="root of build outputs (default: engines, or $PIPELINE_ENGINES_DIR)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")


def _load(args):
    from .config import load_config

    return load_config(args.config)


# ---- handlers -----------------------------------------------------------------------------------------------------

def cmd_schema(args) -> int:
    from .config import json_schema

    print(json.dumps(json_schema(), indent=2))
    return 0


def cmd_check(args) -> int:
    from .stages import run_check

    config = _load(args)
    print(f"check {args.config} ({config.backend} backend)")
    run_check(config)
    print("check passed")
    return 0


def cmd_convert(args) -> int:
    from .stages import run_stages, summary

    config = _load(args)
    start = time.perf_counter()
    results = run_stages(config, args.engines_dir, ("convert",), force=args.force, verify=args.verify)
    print(summary(results))
    print(f"convert done in {time.perf_counter() - start:.1f}s")
    return 0


def cmd_build(args) -> int:
    from .stages import Layout, build_role, run_stages, summary

    config = _load(args)
    if args.dry_run:
        from .backends import get_backend
        from .checks import with_resolved_defaults

        config = with_resolved_defaults(config)  # the converter calls name the concrete dtype, not "auto"
        backend = get_backend(config.backend)
        layout = Layout.for_config(config, args.engines_dir)
        for role in config.roles:
            plan = getattr(backend, "convert_plan", None)
            if plan is not None:
                for line in plan(config, role, layout.stage_dir(role, "convert")):
                    print(line)
            for line in build_role(config, layout, role, dry_run=True):
                print(line)
        return 0
    start = time.perf_counter()
    results = run_stages(config, args.engines_dir, ("convert", "build"), force=args.force, verify=args.verify)
    print(summary(results))
    print(f"engines for {config.name} ready in {args.engines_dir / config.name} "
          f"({time.perf_counter() - start:.1f}s)")
    return 0


VERIFY_HELP = ("hash every output file before calling a stage up to date (default: sizes and mtimes, plus the "
               "hashes of files under 1 MiB); a stage whose outputs changed is redone")


# ---- parser -------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline",
        description="Build, run, serve and benchmark a speculative-decoding DRAFT/TARGET pair from one YAML config.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="STAGE")

    p = sub.add_parser("schema", help="print the config JSON Schema")
    _common(p, config=False)
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser("check", help="validate the config and the pair (tokenizers, architectures, lengths)")
    _common(p)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("convert", help="HF checkpoints -> backend checkpoints (target and draft)")
    _common(p)
    p.add_argument("--force", action="store_true", help="redo even if up to date")
    p.add_argument("--verify", action="store_true", help=VERIFY_HELP)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("build", help="convert (if needed) and build both engines")
    _common(p)
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    p.add_argument("--verify", action="store_true", help=VERIFY_HELP)
    p.add_argument("--dry-run", action="store_true",
                   help="print the exact commands and files without running them (no TensorRT-LLM needed)")
    p.set_defaults(func=cmd_build)

    from .run_cmd import add_run_parser

    add_run_parser(sub, _common)
    from .bench.cli import add_bench_parsers; add_bench_parsers(sub, _common)  # noqa: E702
    from .triton.cli import add_triton_parsers; add_triton_parsers(sub, _common)  # noqa: E702
    from .distill.cli import add_train_parser; add_train_parser(sub, _common)  # noqa: E702
    return parser


# An error message is one line naming the field, the value and the fix; values are cut where they are formatted
# (errors.short_repr), and this bounds whatever slips through (a server error carries its log's last lines).
MAX_MESSAGE_CHARS = 8000


def _check_engines_dir(args) -> None:
    engines_dir = getattr(args, "engines_dir", None)
    if engines_dir is not None and engines_dir.exists() and not engines_dir.is_dir():
        raise PipelineError(f"--engines-dir: {engines_dir} is a file, not a folder; pass the folder that holds "
                            f"(or will hold) engines/<name>/, such as engines")


# Exit status after the reader of stdout went away (`python -m pipeline schema | head`), as a shell reports a
# command killed by SIGPIPE: the output was cut by the reader's choice, so no traceback.
BROKEN_PIPE_EXIT = 128 + 13


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # a closed pipe surfaces here, not as "Exception ignored" at interpreter exit
    except BrokenPipeError:
        # Python ignores SIGPIPE, so a write to a closed pipe raises; later writes (and the final flush) go nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE_EXIT


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_engines_dir(args)
        return args.func(args)
    except PipelineError as exc:
        if args.debug:
            raise
        message = str(exc)
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + f"... ({len(message)} characters, cut)"
        print(f"error: {message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
