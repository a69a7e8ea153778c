"""`python -m pipeline bench CONFIG` and `python -m pipeline profile CONFIG --prompts FILE`."""

from __future__ import annotations

import json
from pathlib import Path

from ..config import MAX_DRAFT_LEN_LIMIT
from ..errors import PipelineError
from .arg_checks import check_range


def add_bench_parsers(sub, common) -> None:
    from .prompts import PROMPT_SETS

    p = sub.add_parser(
        "bench", help="target-only vs speculative (K sweep, dynamic K) vs Hugging Face assisted generation",
        description="Measure tokens/s, latency, acceptance and the cost terms of the analytic speedup model on "
                    "the same prompts for every method; writes engines/<name>/bench/results.json and a PNG plot.")
    common(p)
    p.add_argument("--prompt-set", default=None,
                   help=f"built-in prompts: {', '.join(PROMPT_SETS)}, a comma list of them, or 'all' "
                        f"(default code)")
    p.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                   help="your own prompts instead of --prompt-set: text lines (\\n for newlines), a JSON list, or "
                        "JSONL with text or messages (chats go through the chat template) and an optional set label; "
                        "records are grouped by set")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per set (default 8 of a built-in set, every prompt of a --prompts file)")
    p.add_argument("--k-max", type=int, default=8, help="largest K of the sweep (default 8)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of every method, interleaved (default 3)")
    p.add_argument("--skip-hf", action="store_true", help="leave out Hugging Face generate() (plain and assisted)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default engines/<name>/bench)")
    p.add_argument("--llamacpp", type=Path, default=None, metavar="PATH",
                   help="llama.cpp's llama-bench binary: after our records, run its decode test on GGUFs of the "
                        "same model with torch's thread count and add its tok/s to the table and results.json")
    p.add_argument("--llamacpp-gguf", type=Path, action="append", default=[], metavar="FILE",
                   help="GGUF for --llamacpp; repeatable (default: the GGUF the target was dequantized from)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "profile", help="before building: measure candidate drafts on your prompts and recommend a draft and K",
        description="Loads the target and each candidate draft from their model folders (no engines needed), "
                    "measures per-position acceptance and the cost ratio on your prompts, and recommends the draft "
                    "and K with the highest expected speedup.")
    common(p)
    p.add_argument("--prompts", type=Path, required=True,
                   help="prompts file: one per line (\\n for newlines), a JSON list, or JSONL with text or messages "
                        "(chats go through the target's chat template)")
    p.add_argument("--draft", action="append", default=[], metavar="MODEL",
                   help="candidate draft (folder or hub id); repeatable; default: the config's draft")
    p.add_argument("--medusa", action="append", default=[], metavar="HEADS",
                   help="candidate Medusa heads folder (train-draft --kind medusa); repeatable; default: the config's "
                        "speculative.medusa.model when it has one")
    p.add_argument("--tree", action="append", default=[], metavar="CHOICES",
                   help="Medusa tree to try with each heads folder: a named tree or a JSON list of paths; "
                        "repeatable (default: the config's choices, else every named tree)")
    p.add_argument("--k-max", type=int, default=8, help="largest K considered (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per prompt (default 48)")
    p.add_argument("--json", action="store_true", help="also print the measurements as JSON")
    p.add_argument("--no-ngram", action="store_true",
                   help="leave out the proposers that need no draft model (n-gram lookup, and ngram+draft)")
    p.set_defaults(func=_cmd_profile)

    from .serve_cli import add_bench_serve_parser

    add_bench_serve_parser(sub, common)


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
                                                   draft_quantization=config.build.quantization.draft_mode)
    return executor, f"model folders {target.parent}"


def builtin_prompt_sets(spec: str, num_prompts: int, config) -> dict[str, list[str]]:
    """--prompt-set: "code", a comma list of built-in sets, or "all"."""
    from .prompts import PROMPT_SETS, load_prompt_set, pair_seed_of

    sets = list(PROMPT_SETS) if spec == "all" else [s.strip() for s in spec.split(",")]
    target_folder = config.base_dir / config.target.model
    pair_seed = pair_seed_of(target_folder) if target_folder.is_dir() else 0
    try:
        return {name: load_prompt_set(name, num_prompts, pair_seed=pair_seed) for name in sets}
    except ValueError as exc:
        raise PipelineError(str(exc)) from None


def cmd_bench(args) -> int:
    from ..config import load_config
    from .plot import plot_results
    from .records import format_table
    from .memory import memory_bound, precision
    from .runner import BenchOptions, git_commit, machine_info, run_bench, timestamp

    check_range("--max-new-tokens", args.max_new_tokens, 2, fix="latency needs at least two tokens")
    if args.num_prompts is not None:
        check_range("--num-prompts", args.num_prompts, 1)
    check_range("--k-max", args.k_max, 1, MAX_DRAFT_LEN_LIMIT)
    check_range("--repeats", args.repeats, 1)
    if args.prompts is not None and args.prompt_set is not None:
        raise PipelineError("--prompt-set and --prompts: pass one of them (a built-in set, or your own file, whose "
                            "set labels name the sets)")
    config = load_config(args.config)
    from .llamacpp import plan_from_args  # checked before anything loads: a bad path fails at once

    llamacpp = plan_from_args(args.llamacpp, args.llamacpp_gguf, config)
    if args.prompts is not None:  # read before anything loads: a bad file fails in milliseconds
        from ..prompt_files import encode_items, group_by_set, read_prompt_file

        file_sets = {name: items[:args.num_prompts]
                     for name, items in group_by_set(read_prompt_file(args.prompts, flag="--prompts")).items()}
        executor, source = open_executor(config, args.engines_dir, args.k_max)
        # Chats become token ids through the model's chat template; raw text stays text.
        prompt_sets = {name: encode_items(items, executor.tokenizer, source=config.target.model)
                       for name, items in file_sets.items()}
    else:
        prompt_sets = builtin_prompt_sets(args.prompt_set or "code", args.num_prompts or 8, config)
        executor, source = open_executor(config, args.engines_dir, args.k_max)
    sets = list(prompt_sets)
    num_prompts = max(len(prompts) for prompts in prompt_sets.values())
    options = BenchOptions(prompt_sets=sets, max_new_tokens=args.max_new_tokens, num_prompts=num_prompts,
                           k_max=args.k_max, repeats=args.repeats, skip_hf=args.skip_hf)
    started, commit = timestamp(), git_commit(Path(__file__).resolve().parents[2])  # the code that runs
    records, costs, notes = run_bench(executor, prompt_sets, options)
    bound = memory_bound(executor.target.model, executor.device) if hasattr(executor, "engine") else None
    weights_label = precision(executor.target.model) if bound is not None else None
    for record in records:  # `set` is the name the prompt-file labels use; `prompt_set` stays for older readers
        record.setdefault("set", record["prompt_set"])
        record["fraction_of_memory_bound"] = round(record["tokens_per_s"] / bound.tok_s, 3) if bound else None
        if bound is not None:  # each target forward reads the target's weights once, whatever it verifies
            record.update(precision=weights_label, weight_bytes=bound.weight_bytes,
                          weight_gbs=round(bound.achieved_gbs(record["tokens_per_s"], record["mean_accepted_len"]), 2))
    llamacpp_info = llamacpp_summary = None
    if llamacpp is not None:  # after ours, so the two never compete for the cores
        import torch

        from .llamacpp import run_llamacpp

        llamacpp_records, llamacpp_info, llamacpp_summary = run_llamacpp(
            llamacpp, torch.get_num_threads(), args.max_new_tokens, args.repeats, sets)
        records = records + llamacpp_records
    out_dir = args.out or args.engines_dir / config.name / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "config": config.name, "loaded_from": source, "started": started, "finished": timestamp(),
        "git_commit": commit,
        "machine": machine_info(str(executor.device)),
        "options": {"prompt_sets": sets, "prompts_file": None if args.prompts is None else str(args.prompts),
                    "max_new_tokens": args.max_new_tokens, "num_prompts": num_prompts,
                    "k_max": options.k_max, "repeats": args.repeats, "skip_hf": args.skip_hf,
                    "decoding": "greedy, batch 1"},
        "cost_terms": {**costs.to_dict(), **(bound.to_dict() if bound else {})}, "notes": notes,
        "records": records,
    }
    if llamacpp_info is not None:
        results["llamacpp"] = llamacpp_info
    tmp = out_dir / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(out_dir / "results.json")
    plot = plot_results(records, out_dir / "results.png",
                        f"{config.name} on {results['machine']['device']} ({results['machine']['cpu_count']} cores)"
                        f", {args.max_new_tokens} new tokens, greedy")
    print(format_table(records))
    print(f"cost terms: c = {costs.cost_ratio_c:.3f} (draft {costs.draft_ms:.2f} ms / target {costs.target_ms:.2f} "
          f"ms per token); verify cost K=1..{options.k_max}: "
          + " ".join(f"{v:.2f}" for v in costs.verify_cost_ratio))
    if bound is not None:
        print(f"memory-bound limit: {bound.tok_s:.1f} tok/s (target weights {bound.weight_bytes / 1e6:.0f} MB "
              f"{weights_label} read at a measured {bound.bandwidth_gbs:.1f} GB/s); target-only reached "
              + ", ".join(f"{r['set']} {r['fraction_of_memory_bound']:.2f}" for r in records if r["method"] == "target"))
    for line in summary_lines(records):
        print(line)
    if llamacpp_summary is not None:
        print(llamacpp_summary)
    print(f"wrote {out_dir / 'results.json'} and {plot}")
    return 0


def summary_lines(records: list[dict]) -> list[str]:
    """One line per prompt set: the best speculative K against its bound, and the best HF assisted K."""
    lines = []
    for name in dict.fromkeys(r["prompt_set"] for r in records):
        rows = [r for r in records if r["prompt_set"] == name and r["speedup_vs_target"] is not None]
        spec = [r for r in rows if r["method"] in ("speculative", "ngram")]
        hf = [r for r in rows if r["method"] == "hf_assisted"]
        if spec:
            best = max(spec, key=lambda r: r["speedup_vs_target"])
            lines.append(f"{name}: best {best['method']} K={best['k']} {best['speedup_vs_target']:.2f}x (bound "
                         f"{best['bound_speedup']:.2f}x, with verify cost {best['bound_speedup_refined']:.2f}x, "
                         f"efficiency {best['efficiency']:.2f}); alpha {best['alpha']:.2f}, "
                         f"{best['mean_accepted_len']:.2f} tokens/step")
        for r in (r for r in rows if r["method"] == "adaptive"):
            lines.append(f"{name}: adaptive K {r['speedup_vs_target']:.2f}x target-only"
                         + (f", {r['speedup_vs_target'] / best['speedup_vs_target']:.2f} of the best fixed K"
                            if spec else ""))
        if hf:
            best = max(hf, key=lambda r: r["speedup_vs_target"])
            lines.append(f"{name}: best HF assisted K={best['k']} {best['speedup_vs_target']:.2f}x vs our target-only"
                         + (f" ({best['speedup_vs_hf_target']:.2f}x vs HF target-only)"
                            if best.get("speedup_vs_hf_target") is not None else ""))
    return lines

