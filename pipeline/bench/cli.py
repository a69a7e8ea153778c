"""`python -m pipeline bench CONFIG` and `python -m pipeline profile CONFIG --prompts FILE`.

bench runs in four steps, one module each: plan (what to measure, from the flags, before anything loads), runner
(warm-up, cost terms, one calibration generation per method, timed repeats), estimate (how long the timed part and
a full run take, printed before the timed part starts) and report (results.json, the table, the summary; plot: the
PNG).
"""

from __future__ import annotations

import time
from pathlib import Path

from .plan import DEFAULT_MAX_NEW_TOKENS, DEFAULT_REPEATS, DEFAULT_TOTAL_PROMPTS, k_values_arg


def add_bench_parsers(sub, common) -> None:
    from .serve_cli import add_bench_serve_parser

    _add_bench_parser(sub, common)
    _add_profile_parser(sub, common)
    add_bench_serve_parser(sub, common)


def _add_bench_parser(sub, common) -> None:
    from .prompts import PROMPT_SETS

    p = sub.add_parser(
        "bench", help="target-only vs speculative (K sweep, dynamic K) vs Hugging Face assisted generation",
        description="Measure tokens/s, latency, acceptance and the cost terms of the analytic speedup model on "
                    "the same prompts for every method; writes engines/<name>/bench/results.json and a PNG plot. "
                    "The defaults are a quick run (minutes on a small CPU); before the timed part starts bench "
                    "says how long it will take and how long a full run (the flags it names) would.")
    common(p)
    p.add_argument("--prompt-set", default=None,
                   help=f"built-in prompts: {', '.join(PROMPT_SETS)}, a comma list of them, or 'all' "
                        f"(default code)")
    p.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                   help="your own prompts instead of --prompt-set: text lines (\\n for newlines), a JSON list, or "
                        "JSONL with text or messages (chats go through the chat template) and an optional set label; "
                        "records are grouped by set")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help=f"tokens generated per prompt (default {DEFAULT_MAX_NEW_TOKENS}; a full run: 64)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"prompts per set (default {DEFAULT_TOTAL_PROMPTS} in all, shared among the sets, at least 1 "
                        f"each; a full run: every prompt of a --prompts file, 8 of a built-in set)")
    p.add_argument("--k-max", type=int, default=8, help="largest K measured (default 8)")
    p.add_argument("--k-values", type=k_values_arg, default=None, metavar="LIST",
                   help="K of the sweep: a comma list within 1..--k-max, or 'all' (default: powers of two below "
                        "--k-max, then --k-max: 1,2,4,8)")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help=f"timed repeats of every method, interleaved; the table shows their median and range "
                        f"(default {DEFAULT_REPEATS})")
    p.add_argument("--skip-hf", action="store_true", help="leave out Hugging Face generate() (plain and assisted)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default engines/<name>/bench)")
    p.add_argument("--llamacpp", type=Path, default=None, metavar="PATH",
                   help="llama.cpp's llama-bench binary: after our records, run its decode test on GGUFs of the "
                        "same model with torch's thread count and add its tok/s to the table and results.json")
    p.add_argument("--llamacpp-gguf", type=Path, action="append", default=[], metavar="FILE",
                   help="GGUF for --llamacpp; repeatable (default: the GGUF the target was dequantized from)")
    p.set_defaults(func=cmd_bench)


def _add_profile_parser(sub, common) -> None:
    p = sub.add_parser(
        "profile", help="before building: measure candidate drafts on your prompts and recommend a draft and K",
        description="Loads the target and each candidate draft from their model folders (no engines needed), "
                    "measures per-position acceptance and the cost ratio on your prompts, and recommends the draft "
                    "and K with the highest expected speedup: over all prompts, and for each set label of the "
                    "prompts file.")
    common(p)
    p.add_argument("--prompts", type=Path, required=True,
                   help="prompts file: one per line (\\n for newlines), a JSON list, or JSONL with text or messages "
                        "(chats go through the target's chat template) and an optional set label")
    p.add_argument("--draft", action="append", default=[], metavar="MODEL",
                   help="candidate draft (folder or hub id); repeatable; default: the config's draft")
    p.add_argument("--medusa", action="append", default=[], metavar="HEADS",
                   help="candidate Medusa heads folder (train-draft --kind medusa); repeatable; default: the config's "
                        "speculative.medusa.model when it has one")
    p.add_argument("--eagle3", action="append", default=[], metavar="HEADS",
                   help="candidate EAGLE-3 heads folder (train-draft --kind eagle3); repeatable; default: the config's "
                        "speculative.eagle3.model when it has one")
    p.add_argument("--tree", action="append", default=[], metavar="CHOICES",
                   help="Medusa tree to try with each heads folder: a named tree or a JSON list of paths; "
                        "repeatable (default: the config's choices, else every named tree)")
    p.add_argument("--k-max", type=int, default=8, help="largest K considered (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per prompt (default 48)")
    p.add_argument("--json", action="store_true", help="also print the measurements as JSON")
    p.add_argument("--no-ngram", action="store_true",
                   help="leave out the proposers that need no draft model (n-gram lookup, suffix decoding, and "
                        "ngram+draft)")
    p.set_defaults(func=_cmd_profile)


def _cmd_profile(args) -> int:
    from .profile import cmd_profile

    return cmd_profile(args)


def open_executor(config, engines_dir: Path, k_max: int, note=print):
    """The executor from built engines when they exist, else from the config's model folders (with a note)."""
    from ..executor import SpeculativeExecutor
    from ..models import resolve_model
    from ..run_cmd import load_executor

    from ..layout import Layout

    root = Layout.for_config(config, engines_dir).root
    if all(Layout(root).engine_dir(role).is_dir() for role in config.roles):
        return load_executor(config, engines_dir), f"engines {root}"
    note(f"note: no built engines in {root}; loading the config's model folders with from_pretrained "
         "(run `python -m pipeline build CONFIG` to benchmark the built engines)")
    device = config.runtime.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    from ..checks import with_resolved_defaults

    config = with_resolved_defaults(config)  # dtype: auto -> the dtype the build would choose
    target = resolve_model(config.target, "target", config.base_dir).path
    draft = resolve_model(config.draft, "draft", config.base_dir).path if config.draft is not None else None
    executor = SpeculativeExecutor.from_pretrained(target, draft, max_draft_len=k_max, device=device,
                                                   dtype=config.target.dtype,
                                                   draft_dtype=config.draft.dtype if config.draft else None,
                                                   acceptance=config.speculative.acceptance,
                                                   method=config.speculative.method,
                                                   quantization=config.build.quantization.mode,
                                                   draft_quantization=config.build.quantization.draft_mode,
                                                   compile=config.runtime.torch_compile,
                                                   compile_max_width=config.runtime.compile_max_width)
    return executor, f"model folders {target.parent}"


def cmd_bench(args) -> int:
    from ..config import load_config
    from .llamacpp import plan_from_args as llamacpp_plan
    from .plan import check_args, encoded_sets, plan_from_args
    from .runner import BenchOptions, git_commit, run_bench, timestamp

    began = time.perf_counter()
    check_args(args)
    config = load_config(args.config)
    llamacpp = llamacpp_plan(args.llamacpp, args.llamacpp_gguf, config)  # a bad path fails before anything loads
    plan = plan_from_args(args, config)  # so does a bad prompts file or set name
    print(plan.describe())
    executor, source = open_executor(config, args.engines_dir, plan.k_max)
    prompt_sets = encoded_sets(plan, executor.tokenizer, config.target.model)
    options = BenchOptions(prompt_sets=list(prompt_sets), max_new_tokens=plan.max_new_tokens,
                           num_prompts=plan.num_prompts, k_max=plan.k_max, repeats=plan.repeats,
                           skip_hf=plan.skip_hf, k_values=plan.k_values)
    started, commit = timestamp(), git_commit(Path(__file__).resolve().parents[2])  # the code that runs
    timing: dict = {}

    def announce(methods, seconds) -> None:  # called once the warm-up and the calibration have run
        timing.update(_announce(executor, plan, options, methods, seconds))

    records, costs, notes = run_bench(executor, prompt_sets, options, announce=announce)
    timing["timed_s"] = round(time.perf_counter() - timing.pop("timed_from"), 1)
    return _finish(args, config, executor, source, plan, options, (records, costs, notes),
                   {"started": started, "git_commit": commit, "timing": timing, "began": began}, llamacpp)


def _announce(executor, plan, options, methods, seconds) -> dict:
    """Print how long the timed part will take, and a full run; returns the estimates for results.json."""
    from .estimate import announcement, estimate
    from .plan import FULL_MAX_NEW_TOKENS, FULL_REPEATS
    from .runner import BenchOptions, build_methods

    total = sum(len(prompts) for prompts in plan.prompt_sets.values())
    this = estimate([m.key for m in methods], seconds, total, options.repeats)
    full_options = BenchOptions(prompt_sets=options.prompt_sets, k_max=options.k_max, skip_hf=options.skip_hf)
    full = None if plan.is_full() else estimate(
        [m.key for m in build_methods(executor, full_options)], seconds, sum(plan.full_sizes.values()),
        FULL_REPEATS, FULL_MAX_NEW_TOKENS / options.max_new_tokens)
    shape = (f"{total} prompts in {len(plan.prompt_sets)} sets x {len(methods)} methods x {options.repeats} "
             f"repeats, {options.max_new_tokens} new tokens")
    print(announcement(this, full, plan.full_flags(), shape), flush=True)
    return {"estimated": this.to_dict(), "full_run": None if full is None else
            {"flags": plan.full_flags(), **full.to_dict()}, "timed_from": time.perf_counter()}


def _finish(args, config, executor, source, plan, options, measured, run: dict, llamacpp) -> int:
    """Memory bound, llama.cpp, results.json, the PNG and the printed report."""
    from .estimate import duration
    from .plot import plot_results
    from .report import add_memory_bound, best_by_set, print_report, runner_info, runner_lines, write_results
    from .runner import machine_info, timestamp

    records, costs, notes = measured
    bound = add_memory_bound(records, executor)
    llamacpp_info = llamacpp_summary = None
    if llamacpp is not None:  # after ours, so the two never compete for the cores
        import torch

        from .llamacpp import comparison_line, run_llamacpp

        llamacpp_records, llamacpp_info, llamacpp_summary = run_llamacpp(
            llamacpp, torch.get_num_threads(), plan.max_new_tokens, plan.repeats, options.prompt_sets)
        records = records + llamacpp_records
    timing = {**run["timing"], "total_s": round(time.perf_counter() - run["began"], 1)}
    results = {
        "config": config.name, "loaded_from": source, "started": run["started"], "finished": timestamp(),
        "git_commit": run["git_commit"], "machine": machine_info(str(executor.device)),
        "options": {"prompt_sets": options.prompt_sets,
                    "prompts_file": None if plan.prompts_file is None else str(plan.prompts_file),
                    "max_new_tokens": plan.max_new_tokens, "num_prompts": plan.num_prompts, "k_max": options.k_max,
                    "k_values": options.swept(), "repeats": plan.repeats, "skip_hf": options.skip_hf,
                    "decoding": "greedy, batch 1"},
        "timing": timing, "cost_terms": {**costs.to_dict(), **(bound.to_dict() if bound else {})}, "notes": notes,
        "runners": runner_info(executor), "best": best_by_set(records), "records": records,
    }
    if llamacpp_info is not None:
        results["llamacpp"] = llamacpp_info
    out_dir = args.out or args.engines_dir / config.name / "bench"
    path = write_results(out_dir, results)
    machine = results["machine"]
    plot = plot_results(records, out_dir / "results.png",
                        f"{config.name} on {machine['device']} ({machine['cpu_count']} cores), "
                        f"{plan.max_new_tokens} new tokens, greedy, {plan.repeats} repeats")
    print_report(records, costs, bound, options.k_max)
    print("\n".join(runner_lines(results["runners"])))
    if llamacpp_summary is not None:
        print(llamacpp_summary)
        if (line := comparison_line(records)) is not None:
            print(line)
    print(f"bench took {duration(timing['total_s'])} (timed part {duration(timing['timed_s'])}, estimated "
          f"{duration(timing['estimated']['seconds'])})")
    print(f"wrote {path} and {plot}")
    return 0
