"""`python -m pipeline run CONFIG`: generate from prompts with the built engines; print text and statistics."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import PipelineError


def add_run_parser(sub, common) -> None:
    p = sub.add_parser("run", help="generate from prompts with the built engines; prints text and acceptance")
    common(p)
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompts-file", type=Path, help="file with one prompt per line (or a JSON list of strings)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-draft-len", type=int, default=None, help="K for this run (0 = target only)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are accepted (first prompt)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.set_defaults(func=cmd_run)


def _read_prompts_file(path: Path) -> list[str]:
    """One prompt per non-empty line (``\\n`` for a newline inside one), or a JSON list of strings."""
    where = f"--prompts-file: {path}"
    if path.is_dir():
        raise PipelineError(f"{where} is a folder; pass a text file with one prompt per line")
    if not path.is_file():
        raise PipelineError(f"{where} not found (or not a regular file); pass a text file with one prompt per line")
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise PipelineError(f"{where} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except OSError as exc:
        raise PipelineError(f"{where} cannot be read ({exc.strerror})") from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except ValueError as exc:
            raise PipelineError(f"{where} starts with '[' but is not a valid JSON list ({exc}); write a JSON "
                                f"list of strings, or one prompt per line") from None
        bad = next((i for i, item in enumerate(items) if not isinstance(item, str)), None)
        if bad is not None:
            raise PipelineError(f"{where}: item {bad} is {type(items[bad]).__name__}, not a string; a JSON prompts "
                                f"file is a list of strings")
        found = items
    else:
        found = [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]
    if not found:
        raise PipelineError(f"{where} holds no prompts; write one prompt per line")
    return found


def read_prompts(prompts: list[str], prompts_file: Path | None) -> list[str]:
    found = list(prompts)
    if prompts_file is not None:
        found += _read_prompts_file(prompts_file)
    if not found:
        raise PipelineError("run: no prompts; pass --prompt TEXT or --prompts-file FILE")
    return found


def proposer_options(config) -> dict:
    """from_engines keywords for the config's drafting method (draft model, n-gram lookup or both)."""
    from .executor.proposers import NgramSettings

    spec = config.speculative
    return dict(method=spec.method, ngram=NgramSettings(spec.ngram.min_match, spec.ngram.max_match))


def load_executor(config, engines_dir: Path):
    """The executor on this config's engines, after checking they were built from this very config."""
    from .executor import SpeculativeExecutor
    from .stages import verify_engines

    verify_engines(config, engines_dir)
    device = None if config.runtime.device == "auto" else config.runtime.device
    proposer = proposer_options(config)
    if config.backend == "torch":
        return SpeculativeExecutor.from_engines(engines_dir / config.name, device=device,
                                                compile=config.runtime.torch_compile, **proposer)
    return SpeculativeExecutor.from_engines(engines_dir / config.name, device=device, **proposer)


def cmd_run(args) -> int:
    import sys

    from .config import load_config
    from .executor import GenerationStats

    from .triton.request_inputs import check_generation_values

    # The server's rules, checked before anything loads (the executor alone would take temperature inf).
    check_generation_values(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, names={
        "max_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
        "seed": "--seed"})
    config = load_config(args.config)
    prompts = read_prompts(args.prompt, args.prompts_file)
    executor = load_executor(config, args.engines_dir)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, max_draft_len=args.max_draft_len)
    if args.stream:
        print(prompts[0], end="", flush=True)
        event = None
        for event in executor.generate_stream(prompts[0], **options):
            print(event.text, end="", flush=True)
        print()
        if event is not None:
            print(f"[{event.finish_reason}] {event.stats.summary()}")
        return 0
    results = executor.generate(prompts, **options)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
        return 0
    total = GenerationStats()
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        print(f"--- prompt {i} ({result.prompt_tokens} tokens) ---")
        print(prompt + result.text)
        print(f"[{result.finish_reason}, {len(result.token_ids)} tokens] {result.stats.summary()}")
        total = total.merge(result.stats)
    print(f"=== total: {total.summary()}", file=sys.stdout)
    return 0
