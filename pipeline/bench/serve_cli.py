"""`python -m pipeline bench-serve CONFIG`: serving throughput and latency under concurrent clients.

For every path (serve_clients: the Python engine behind ServingLoop; the real tritonserver over HTTP and over a gRPC
stream) and concurrency C, C client threads send their share of N greedy requests, one after another, in each
mode (serve_matrix); cells are interleaved over rounds and each keeps its best. Also measured, before the engine
serves anything: at batch 1 on the same prompts, our target-only decoding against Hugging Face ``generate`` greedy
(hf_baseline). Each cell also records the prefix cache's hit rate and the engine's mean batch occupancy over its
requests (the engine's own totals, or the served engine model's Prometheus counters for the Triton paths); the
``chat`` prompt set (one long system prompt before every question) is the one that exercises prefix reuse.
Writes engines/<name>/bench/serving.json and serving.png.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from ..errors import PipelineError
from .arg_checks import check_known, check_range, int_list, name_list
from .prompts import PROMPT_SETS
from .serve_matrix import MODES, PATHS, ServeOptions, is_mode, mode_method

SERVE_PROMPT_SETS = (*PROMPT_SETS, "chat")


def add_bench_serve_parser(sub, common) -> None:
    p = sub.add_parser(
        "bench-serve", help="serving under concurrent clients: one-at-a-time vs batched target-only vs speculative",
        description="C client threads send their share of N greedy requests through the Python engine and through "
                    "a real tritonserver on loopback, in each mode; tokens/s, requests/s, ITL and TTFT p50/p99 per "
                    "(path, mode, C), best of interleaved rounds; plus batch-1 target-only vs HF generate. Writes "
                    "engines/<name>/bench/serving.json and serving.png.")
    common(p)
    p.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8, 16, 32],
                   help="comma list (default 1,2,4,8,16,32)")
    p.add_argument("--requests", type=int, default=64, help="requests per (path, mode, C) (default 64)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds; each cell reports its median and min/max (default 3)")
    p.add_argument("--modes", type=name_list, default=list(MODES), help=f"comma list (default {','.join(MODES)})")
    p.add_argument("--paths", type=name_list, default=list(PATHS), help=f"comma list (default {','.join(PATHS)})")
    p.add_argument("--prompt-set", default="code",
                   help=f"built-in prompt set: {', '.join(SERVE_PROMPT_SETS)} (default code); chat puts one long "
                        f"system prompt before every question, through the chat template when the tokenizer has one")
    p.add_argument("--prompts", default=None, metavar="FILE|NAME",
                   help="your prompts instead of --prompt-set (a prompts file as bench takes it, chats through the "
                        "chat template), or a shipped set by name: categories (9 categories of chats), tasks, "
                        "agentic; sets are interleaved so every category is in the traffic")
    p.add_argument("--num-prompts", type=int, default=8, help="distinct prompts, sent in turn (default 8)")
    p.add_argument("--hf-rounds", type=int, default=3,
                   help="rounds of batch-1 target-only vs HF generate (0 skips it; default 3)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default engines/<name>/bench)")
    p.set_defaults(func=cmd_bench_serve)


def _checked_options(args) -> ServeOptions:
    options = ServeOptions(concurrency=args.concurrency, requests=args.requests, max_tokens=args.max_tokens,
                           rounds=args.rounds, modes=args.modes, paths=args.paths, hf_rounds=args.hf_rounds)
    check_range("--max-tokens", options.max_tokens, 2, fix="latency needs at least two tokens")
    check_range("--requests", options.requests, 1)
    check_range("--rounds", options.rounds, 1)
    check_range("--hf-rounds", options.hf_rounds, 0)
    for c in options.concurrency:
        check_range("--concurrency", c, 1, options.requests, fix="each client needs at least one request")
    unknown = [mode for mode in options.modes if not is_mode(mode)]
    if unknown:
        raise PipelineError(f"--modes: {', '.join(unknown)} unknown; choose from {', '.join(MODES)}, "
                            f"speculative_kN (every request names K = N) or method_NAME (every request names the "
                            f"drafting method NAME, such as method_suffix)")
    check_known("--paths", options.paths, PATHS)
    check_known("--prompt-set", [args.prompt_set], SERVE_PROMPT_SETS)
    return options


def cmd_bench_serve(args) -> int:
    from ..config import load_config
    from .runner import git_commit, timestamp

    options = _checked_options(args)
    config = load_config(args.config)
    texts = _prompt_texts(args, config)  # before the models load: a bad set fails at once
    opened = time.perf_counter()
    executor = _open_engines(args, config)
    startup_s = time.perf_counter() - opened  # loading and compiling, kept apart from every measured cell
    prompts, shared_prefix = _fitted_prompts(executor, texts, args.num_prompts, options.max_tokens)
    started, commit = timestamp(), git_commit(Path(__file__).resolve().parents[2])
    batch1 = None
    if options.hf_rounds:  # before the ServingLoop exists: it runs on the executor's engine directly
        from .hf_baseline import batch1_target_vs_hf

        batch1 = batch1_target_vs_hf(executor, prompts, options.max_tokens, options.hf_rounds)
        print(f"batch 1, target only: ours {batch1['target_tokens_per_s']:.1f} tok/s, HF generate "
              f"{batch1['hf_target_tokens_per_s']:.1f} tok/s ({batch1['target_vs_hf']:.2f}x)")
    out_dir = args.out or args.engines_dir / config.name / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    phases = {"startup_s": round(startup_s, 2)}
    records = _run_cells(args, config, executor, prompts, options, out_dir, phases)
    method = config.speculative.method
    for record in records:
        record["method"] = None if record["mode"] == "target_only" else mode_method(record["mode"]) or method
    _report(config, executor, records, batch1, out_dir, {
        "started": started, "git_commit": commit, "phases": phases,
        "model": config.target.model, "draft": _draft_description(config),
        "options": {**options.to_dict(), "prompt_set": args.prompts or args.prompt_set, "num_prompts": len(prompts),
                    "shared_prefix_tokens": shared_prefix, "decoding": "greedy",
                    "max_batch_size": executor.max_batch_size, "k": executor.max_draft_len,
                    "adaptive_draft_len": True, "method": method}})
    return 0


def _draft_description(config) -> str:
    """What drafts, for the results: the draft model, the method's heads folder, or the lookup method's name."""
    spec = config.speculative
    heads = {"eagle3": spec.eagle3, "medusa": spec.medusa}.get(spec.method)
    if heads is not None:
        return str(heads.model)
    if config.draft is not None and spec.method in ("draft_model", "ngram+draft"):
        return config.draft.model
    return spec.method


def _prompt_texts(args, config) -> list[str] | None:
    """The built-in set's texts; None for chat, which needs the tokenizer (encoded once the engines are open)."""
    from ..errors import PipelineError
    from .prompts import load_prompt_set, pair_seed_of

    if args.prompts is not None:
        return _file_prompts(args, config)
    if args.prompt_set == "chat":
        return None
    target_folder = config.base_dir / config.target.model
    pair_seed = pair_seed_of(target_folder) if target_folder.is_dir() else 0
    try:
        return load_prompt_set(args.prompt_set, args.num_prompts, pair_seed=pair_seed)
    except ValueError as exc:
        raise PipelineError(str(exc)) from None


def _file_prompts(args, config) -> list:
    """A prompts file's (or shipped set's) items, the sets interleaved (one of each in turn) so that the first
    --num-prompts hold every set: raw texts as text, chats as message lists (encoded once the tokenizer is open)."""
    from itertools import chain, zip_longest

    from ..prompt_files import group_by_set, read_prompt_file

    groups = list(group_by_set(read_prompt_file(args.prompts, flag="--prompts")).values())
    mixed = [item for item in chain.from_iterable(zip_longest(*groups)) if item is not None]
    return [item.messages if item.is_chat else item.text for item in mixed[:args.num_prompts]]


def _open_engines(args, config):
    from ..errors import PipelineError
    from ..executor import open_executor

    root = args.engines_dir / config.name
    if not (root / "target" / "build").is_dir():
        raise PipelineError(f"{root}: no built engines; run `python -m pipeline build {args.config}` first")
    device = None if config.runtime.device == "auto" else config.runtime.device
    return open_executor(root, config, device=device, adaptive_draft_len=True)


def _fitted_prompts(executor, texts: list[str] | None, num_prompts: int, max_tokens: int
                    ) -> tuple[list[list[int]], int | None]:
    """Token ids that fit the engine, and how many first tokens they all share (chat only, else None)."""
    from ..errors import PipelineError
    from .prompts import chat_prompt_ids, fit_shared_prefix
    from .runner import fit_prompt

    if texts is not None:
        return [fit_prompt(executor, _encoded(executor, text), max_tokens) for text in texts], None
    try:
        return fit_shared_prefix(*chat_prompt_ids(executor.tokenizer, num_prompts),
                                 lambda ids: fit_prompt(executor, ids, max_tokens))  # encode passes ids through
    except ValueError as exc:
        raise PipelineError(str(exc)) from None


def _encoded(executor, prompt):
    """A chat (a message list) as token ids (prompts.chat_ids); text and ids as they are."""
    from .prompts import chat_ids

    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        return chat_ids(executor.tokenizer, prompt)
    return prompt


def _run_cells(args, config, executor, prompts: list[list[int]], options: ServeOptions, out_dir: Path,
               phases: dict) -> list[dict]:
    """Every (path, mode, C) cell: the engine in this process, and a tritonserver (with the OpenAI endpoint in
    front of it for the openai path) when a served path is asked for."""
    from ..executor.serving_loop import ServingLoop
    from .memory import weight_bytes
    from .serve_clients import EngineClient, OpenAIClient, TritonHttpClient, TritonStreamClient, engine_totals, \
        triton_totals
    from .serve_matrix import add_ratios, run_matrix
    from .triton_launch import start_openai, start_triton

    loop = ServingLoop(executor.engine)
    clients: dict[str, Callable[[], object]] = {"engine": lambda: EngineClient(executor, loop)}
    totals: dict[str, Callable[[], dict]] = {"engine": lambda: engine_totals(executor.engine)}
    server = openai = None
    try:
        if {"triton", "triton_stream", "openai"} & set(options.paths):
            started = time.perf_counter()
            server = start_triton(config, args.engines_dir, out_dir / "serving-tritonserver.log")
            clients["triton"] = lambda: TritonHttpClient(server.endpoints.http)
            clients["triton_stream"] = lambda: TritonStreamClient(server.endpoints.grpc)
            served = lambda: triton_totals(server.endpoints.metrics_url)  # noqa: E731
            totals["triton"] = totals["triton_stream"] = totals["openai"] = served
            if "openai" in options.paths:
                openai = start_openai(config, args.engines_dir, server.endpoints.grpc)
                clients["openai"] = lambda: OpenAIClient(openai.url, config.name)
            phases["server_start_s"] = round(time.perf_counter() - started, 2)
        clients = {path: make for path, make in clients.items() if path in options.paths}
        records = run_matrix(clients, prompts, options, executor.max_draft_len, totals=totals,
                             max_batch=executor.max_batch_size, weight_bytes=weight_bytes(executor.engine.target.model),
                             phases=phases)
    finally:
        loop.stop()
        if openai is not None:
            openai.stop()
        if server is not None:
            server.stop()
    add_ratios(records)
    return records


def _report(config, executor, records: list[dict], batch1: dict | None, out_dir: Path, run: dict) -> None:
    """serving.json (written whole through a temporary file), serving.png, the table and the serving goals."""
    import json
    import os

    from .runner import machine_info, timestamp
    from .serve_plot import plot_serving
    from .serve_report import format_serving_table, targets_met
    from .specdec_layout import write_specdec

    machine = {**machine_info(str(executor.device)), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    results = {"config": config.name, "started": run["started"], "finished": timestamp(),
               "git_commit": run["git_commit"], "machine": machine, "options": run["options"],
               "model": run["model"], "draft": run["draft"], "phases": run["phases"],
               "records": records, "batch1_target_vs_hf": batch1, "targets": targets_met(records)}
    tmp = out_dir / "serving.json.tmp"
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(out_dir / "serving.json")
    specdec = write_specdec(records, {**run, "config": config.name, "machine": machine,
                                      "finished": results["finished"]}, out_dir / "specdec_bench")
    plot = plot_serving(records, out_dir / "serving.png",
                        f"{config.name}: {machine['cpu']} ({machine['cpu_count']} cores, {machine['torch_threads']} "
                        f"torch threads), {run['options']['max_tokens']} tokens/request greedy, engine batch "
                        f"{executor.max_batch_size}, K={executor.max_draft_len}")
    print(format_serving_table(records))
    for line in results["targets"]:
        print(line)
    print(f"wrote {out_dir / 'serving.json'}, {plot} and {len(specdec)} files in specdec_bench's layout under "
          f"{out_dir / 'specdec_bench'}")
