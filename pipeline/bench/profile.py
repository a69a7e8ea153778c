"""`python -m pipeline profile CONFIG --prompts FILE [--draft MODEL ...]`: pick a draft and K before building.

For each candidate draft: load it beside the target with SpeculativeExecutor.from_pretrained (no engines), generate
greedily at K = k_max on the user's prompts, and read the per-position acceptance. Greedy acceptance of the draft
token at position i depends only on the text so far, not on K, so one run at k_max measures it for every K <= k_max.
With the measured cost ratio c and verify cost v_K, the expected speedup of K is

    (1 + sum of acceptance_by_position[:K]) / (K c + v_K)

(tokens a step emits over what a step costs, in target single-token forwards), which needs no i.i.d. assumption.

Beside the drafts it measures the proposers that need no draft model, on the same prompts:
  ngram        lookups in the prompt and output (c = 0); acceptance per position is counted per target step,
               so steps where nothing matched (plain decoding) weigh in;
  ngram+DRAFT  the per-step choice between lookup and that draft, run at K = k_max: its tokens per step over its
               cost per step (the verify, plus K c on the steps where the draft ran).
  medusa:TREE  Medusa heads (--medusa, one run per tree in --tree): a tree step's cost is not a chain's K c + v_K,
               so it is timed: target-only and Medusa decode the same prompts at batch 1, interleaved over
               MEDUSA_ROUNDS rounds, each keeping its best; the speedup is the measured ratio (on this machine).
The recommendation names the method (speculative.method) as well as the draft and K (or the tree).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import PipelineError
from ..methods import Method
from ..speculative.tree_choices import NAMED_TREES
from ..speculative.analytic import best_k_from_survival, expected_tokens_from_survival, speedups_from_survival
from .arg_checks import check_range
from .medusa_profile import tune_tree


@dataclass
class DraftProfile:
    draft: str  # as the user named it ("ngram" for lookups alone)
    status: str  # "ok" | "incompatible" | "unavailable"
    reason: str = ""  # why not ok
    acceptance_rate: float = 0.0  # accepted / drafted at K = k_max
    acceptance_by_position: list[float] = field(default_factory=list)  # [k_max]
    cost_ratio_c: float = 0.0
    verify_cost_ratio: list[float] = field(default_factory=list)  # [k_max], K = 1..k_max
    expected_speedup: list[float] = field(default_factory=list)  # [k_max], K = 1..k_max
    best_k: int = 0
    best_speedup: float = 0.0
    method: Method = Method.DRAFT_MODEL  # the speculative.method this candidate is
    draft_step_share: float = 1.0  # ngram+draft: share of speculative steps the draft model proposed
    dtype: str = ""  # the dtype the draft ran in (its cost ratio c depends on it); "" for lookups
    tokens_per_step: float = 0.0  # medusa: tokens emitted per target step (its tree steps and its first, plain one)
    choices: list | str | None = None  # medusa: the tree measured

    def reasoning(self) -> str:
        if self.status != "ok":
            return f"{self.draft}: {self.status}: {self.reason}"
        k = self.best_k
        if self.method == Method.MEDUSA:
            by_depth = " ".join(f"{p:.2f}" for p in self.acceptance_by_position)
            return (f"{self.draft}: acceptance by tree depth [{by_depth}], {self.tokens_per_step:.2f} tokens per "
                    f"target step; measured {self.best_speedup:.2f}x target-only on these prompts (wall clock, "
                    f"batch 1, best of {MEDUSA_ROUNDS} interleaved rounds)")
        if self.method == Method.NGRAM_DRAFT:
            return (f"{self.draft}: at K={k} the draft proposed in {self.draft_step_share:.0%} of speculative steps, "
                    f"lookups in the rest; tokens per step over cost per step = {self.best_speedup:.2f}x")
        tokens = expected_tokens_from_survival(self.acceptance_by_position, k)
        by_pos = " ".join(f"{p:.2f}" for p in self.acceptance_by_position)
        return (f"{self.draft}: acceptance by position [{by_pos}], c = {self.cost_ratio_c:.3f}; K={k} maximises "
                f"(1 + accepted by position[:K]) / (K c + verify_K) = {tokens:.2f} / ({k} x {self.cost_ratio_c:.3f} "
                f"+ {self.verify_cost_ratio[k - 1]:.2f}) = {self.best_speedup:.2f}x")


def profile_draft(target_path: Path, draft_name: str, draft_path: Path | None, prompts: list[str | list[int]],
                  k_max: int, max_new_tokens: int, device: str, dtype: str, cost_repeats: int = 15,
                  draft_dtype: str | None = None) -> DraftProfile:
    """Measure one candidate (in ``draft_dtype``, default the target's ``dtype``); a draft whose tokenizer differs
    comes back 'incompatible' instead of raising."""
    from ..executor import RequestError, SpeculativeExecutor
    from .runner import fit_prompt
    from .timing import measure_costs

    if draft_path is None:
        return DraftProfile(draft_name, "unavailable", "not found")
    try:
        executor = SpeculativeExecutor.from_pretrained(target_path, draft_path, max_draft_len=k_max, device=device,
                                                       dtype=dtype, draft_dtype=draft_dtype)
    except RequestError as exc:  # from_pretrained's tokenizer comparison
        return DraftProfile(draft_name, "incompatible", str(exc))
    except PipelineError as exc:
        return DraftProfile(draft_name, "unavailable", str(exc))
    ids = [fit_prompt(executor, p, max_new_tokens) for p in prompts]
    results = executor.generate(ids, max_new_tokens, temperature=0.0, max_draft_len=k_max)
    stats = _total(results)
    survival = list(stats.acceptance_by_position)
    if len(survival) < k_max:
        return DraftProfile(draft_name, "unavailable", f"only {len(survival)} draft positions measured; raise "
                                                       f"--max-new-tokens above --k-max {k_max}")
    costs = measure_costs(executor.target, executor.draft, _context(ids, results, k_max), k_max,
                          repeats=cost_repeats)
    speedups = speedups_from_survival(survival, costs.cost_ratio_c, costs.verify_cost_ratio)
    best_k, best_speedup = best_k_from_survival(survival, costs.cost_ratio_c, costs.verify_cost_ratio)
    return DraftProfile(draft_name, "ok", "", stats.acceptance_rate, survival, costs.cost_ratio_c,
                        costs.verify_cost_ratio, speedups, best_k, best_speedup, dtype=draft_dtype or dtype)


def profile_lookup(target_path: Path, prompts: list[str | list[int]], k_max: int, max_new_tokens: int, device: str,
                   dtype: str, cost_repeats: int = 15) -> DraftProfile:
    """N-gram lookups alone: acceptance per position per target step, c = 0 (no model proposes)."""
    from ..executor import SpeculativeExecutor
    from .runner import fit_prompt
    from .timing import measure_costs

    executor = SpeculativeExecutor.from_pretrained(target_path, None, max_draft_len=k_max, device=device,
                                                   dtype=dtype, method=Method.NGRAM)
    ids = [fit_prompt(executor, p, max_new_tokens) for p in prompts]
    results = executor.generate(ids, max_new_tokens, temperature=0.0, max_draft_len=k_max)
    stats = _total(results)
    # Per target step, not per proposal: a step where nothing matched emits one token at full cost.
    accepted_at = stats.accepted_at + [0] * (k_max - len(stats.accepted_at))
    survival = [a / stats.target_steps for a in accepted_at[:k_max]]
    costs = measure_costs(executor.target, None, _context(ids, results, k_max), k_max, repeats=cost_repeats)
    speedups = speedups_from_survival(survival, 0.0, costs.verify_cost_ratio)
    best_k, best_speedup = best_k_from_survival(survival, 0.0, costs.verify_cost_ratio)
    return DraftProfile("ngram", "ok", "", stats.acceptance_rate, survival, 0.0, costs.verify_cost_ratio,
                        speedups, best_k, best_speedup, method=Method.NGRAM)


MEDUSA_ROUNDS = 2


def profile_medusa(target_path: Path, heads: Path, choices, prompts: list, max_new_tokens: int, device: str,
                   dtype: str) -> DraftProfile:
    """Medusa heads with one tree: greedy acceptance per depth, and the speedup timed against target-only."""
    from ..executor import SpeculativeExecutor
    from .runner import fit_prompt

    label = f"medusa:{choices if isinstance(choices, str) else f'{len(choices)} nodes'}"
    try:
        executor = SpeculativeExecutor.from_pretrained(target_path, None, device=device, dtype=dtype,
                                                       method=Method.MEDUSA, medusa=heads, medusa_choices=choices)
    except (PipelineError, ValueError, OSError) as exc:
        return DraftProfile(label, "unavailable", str(exc), method=Method.MEDUSA, choices=choices)
    ids = [fit_prompt(executor, p, max_new_tokens) for p in prompts]
    best = {0: float("inf"), None: float("inf")}  # K 0: target-only; None: the tree's depth
    results = []
    for _ in range(MEDUSA_ROUNDS):
        for k in best:
            start = time.perf_counter()
            run = [executor.generate([x], max_new_tokens, temperature=0.0, max_draft_len=k)[0] for x in ids]
            best[k] = min(best[k], time.perf_counter() - start)
            if k is None:
                results = run
    stats = _total(results)
    return DraftProfile(label, "ok", "", stats.acceptance_rate, stats.acceptance_by_position, 0.0, [], [],
                        executor.max_draft_len, best[0] / best[None], method=Method.MEDUSA,
                        dtype=str(executor.target.dtype).removeprefix("torch."),
                        tokens_per_step=stats.mean_accepted_len, choices=choices)


def profile_hybrid(target_path: Path, draft: DraftProfile, draft_path: Path, prompts: list[str | list[int]],
                   k_max: int, max_new_tokens: int, device: str, dtype: str,
                   draft_dtype: str | None = None) -> DraftProfile:
    """ngram+draft at K = k_max, costed with the draft's measured c and verify cost."""
    from ..executor import SpeculativeExecutor
    from .runner import fit_prompt

    executor = SpeculativeExecutor.from_pretrained(target_path, draft_path, max_draft_len=k_max, device=device,
                                                   dtype=dtype, method=Method.NGRAM_DRAFT, draft_dtype=draft_dtype)
    ids = [fit_prompt(executor, p, max_new_tokens) for p in prompts]
    stats = _total(executor.generate(ids, max_new_tokens, temperature=0.0, max_draft_len=k_max))
    steps = stats.target_steps
    draft_steps = stats.by_proposer.get(Method.DRAFT_MODEL, [0, 0, 0])[2]
    lookup_steps = stats.by_proposer.get(Method.NGRAM, [0, 0, 0])[2]
    share = draft_steps / max(draft_steps + lookup_steps, 1)
    verify = draft.verify_cost_ratio[k_max - 1]
    cost_per_step = verify + (draft_steps / steps) * k_max * draft.cost_ratio_c
    speedup = (stats.generated_tokens / steps) / cost_per_step
    return DraftProfile(f"ngram+{draft.draft}", "ok", "", stats.acceptance_rate, [], draft.cost_ratio_c,
                        draft.verify_cost_ratio, [], k_max, speedup, method=Method.NGRAM_DRAFT, draft_step_share=share,
                        dtype=draft.dtype)


def _total(results):
    stats = results[0].stats
    for result in results[1:]:
        stats = stats.merge(result.stats)
    return stats


def _context(ids, results, k_max: int) -> list[int]:
    # The longest prompt plus its generated tokens gives a realistic attention length to time at.
    context = max((p + r.token_ids for p, r in zip(ids, results)), key=len)
    return context if len(context) >= k_max + 1 else (context * (k_max + 1))[:k_max + 1]


def recommendation(profiles: list[DraftProfile]) -> str:
    usable = [p for p in profiles if p.status == "ok"]
    if not usable:
        return "recommend: nothing to recommend; no candidate draft could be measured (see the reasons above)"
    best = max(usable, key=lambda p: p.best_speedup)
    if best.best_speedup <= 1.0:
        how = "measured" if best.method == Method.MEDUSA else "expected"
        return (f"recommend: serve the target alone; the best candidate ({best.draft}, K={best.best_k}) is "
                f"{how} at {best.best_speedup:.2f}x, not faster than target-only decoding")
    if best.method == Method.MEDUSA:
        return (f"recommend: speculative.method: medusa with speculative.medusa.choices: {best.choices} (measured "
                f"{best.best_speedup:.2f}x over target-only decoding)")
    if best.method == Method.NGRAM:
        return (f"recommend: speculative.method: ngram with speculative.max_draft_len: {best.best_k}, no draft "
                f"model (expected {best.best_speedup:.2f}x over target-only decoding)")
    if best.method == Method.NGRAM_DRAFT:
        return (f"recommend: speculative.method: ngram+draft with draft {best.draft.removeprefix('ngram+')} and "
                f"speculative.max_draft_len: {best.best_k} (expected {best.best_speedup:.2f}x over target-only "
                f"decoding)")
    return (f"recommend: speculative.method: draft_model with draft {best.draft} and speculative.max_draft_len: "
            f"{best.best_k} (expected {best.best_speedup:.2f}x over target-only decoding)")


def format_profiles(profiles: list[DraftProfile]) -> str:
    header = ["draft", "status", "dtype", "accept", "c", "best K", "speedup", "expected speedup K=1.."]
    rows = []
    for p in profiles:
        if p.status == "ok" and p.method == Method.MEDUSA:
            rows.append([p.draft, p.status, p.dtype, f"{p.acceptance_rate:.2f}", "-", f"{p.best_k} (depth)",
                         f"{p.best_speedup:.2f}x", f"measured; {p.tokens_per_step:.2f} tokens/step"])
        elif p.status == "ok":
            rows.append([p.draft, p.status, p.dtype or "-", f"{p.acceptance_rate:.2f}", f"{p.cost_ratio_c:.3f}",
                         str(p.best_k), f"{p.best_speedup:.2f}x", " ".join(f"{s:.2f}" for s in p.expected_speedup)])
        else:
            rows.append([p.draft, p.status, "-", "-", "-", "-", "-", "-"])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in [header] + rows)


def _resolve_draft(name: str, config) -> Path | None:
    """The config's own draft resolves against the config's folder; --draft values against the working folder."""
    from ..config import ModelSpec
    from ..errors import ModelError
    from ..models import resolve_model

    own = config.draft is not None and name == config.draft.model
    spec = config.draft if own else ModelSpec(model=name, dtype=config.target.dtype if config.draft is None
                                              else config.draft.dtype)
    try:
        return resolve_model(spec, "draft", config.base_dir if own else Path.cwd()).path
    except ModelError:
        return None


def _draft_dtype(name: str, path: Path | None, config, device: str) -> str | None:
    """The dtype a build would run this candidate in: the config's choice for its own draft, else `dtype: auto`
    on the candidate's checkpoint (a 16-bit draft stays 16-bit where this device runs that type natively)."""
    from ..dtypes import checkpoint_dtype, resolve_dtype

    if config.draft is not None and name == config.draft.model:
        return config.draft.dtype
    if path is None or not (path / "config.json").is_file():
        return None
    return resolve_dtype("auto", checkpoint_dtype(json.loads((path / "config.json").read_text())), "torch",
                         device).dtype


def _tree_arg(value: str):
    """--tree: a named tree, or a JSON list of paths (checked as speculative.medusa.choices is)."""
    from ..speculative.tree import TokenTree

    if value in NAMED_TREES:
        return value
    try:
        paths = json.loads(value)
        TokenTree.from_choices(paths)
    except ValueError as exc:
        raise PipelineError(f"--tree: {value!r} is not a named tree ({', '.join(NAMED_TREES)}) or a JSON list of "
                            f"paths such as [[0], [0, 0], [1]] ({exc})") from None
    return paths


def cmd_profile(args) -> int:
    from ..config import MAX_DRAFT_LEN_LIMIT, load_config
    from ..models import load_tokenizer, resolve_model
    from ..prompt_files import encode_items, read_prompt_file

    check_range("--k-max", args.k_max, 1, MAX_DRAFT_LEN_LIMIT)
    if args.max_new_tokens <= args.k_max:
        raise PipelineError(f"--max-new-tokens: {args.max_new_tokens} must exceed --k-max {args.k_max} so every "
                            f"draft position is measured; raise it")
    items = read_prompt_file(args.prompts, flag="--prompts")
    from ..checks import with_resolved_defaults

    config = with_resolved_defaults(load_config(args.config))  # dtype: auto -> what a build would choose
    device = config.runtime.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved_target = resolve_model(config.target, "target", config.base_dir)
    target = resolved_target.path
    # Chats become token ids through the target's chat template; raw text stays text (the executor encodes it).
    tokenizer = load_tokenizer(resolved_target) if any(item.is_chat for item in items) else None
    prompts = encode_items(items, tokenizer, source=config.target.model)
    from tqdm import tqdm

    profiles = []
    names = args.draft or ([config.draft.model] if config.draft is not None and not args.medusa else [])
    for name in tqdm(names, desc="profile", unit="draft"):
        path = _resolve_draft(name, config)
        draft_dtype = _draft_dtype(name, path, config, device)
        profiles.append(profile_draft(target, name, path, prompts, args.k_max, args.max_new_tokens, device,
                                      config.target.dtype, draft_dtype=draft_dtype))
        if not args.no_ngram and profiles[-1].status == "ok":
            profiles.append(profile_hybrid(target, profiles[-1], path, prompts, args.k_max, args.max_new_tokens,
                                           device, config.target.dtype, draft_dtype=draft_dtype))
    medusa_spec = config.speculative.medusa if config.has_medusa_heads else None
    heads = [Path(h) for h in args.medusa] or ([config.medusa_dir()] if medusa_spec is not None else [])
    trees = [_tree_arg(t) for t in args.tree] or ([medusa_spec.choices] if medusa_spec is not None
                                                  else list(NAMED_TREES))
    for folder in heads:
        if not args.tree:  # a tree tuned to these heads, prompts and machine, beside the configured or named ones
            tuned = tune_tree(target, folder, prompts, args.max_new_tokens, device, config.target.dtype)
            trees = trees + ([tuned.paths] if tuned.paths else [])
            print(tuned.describe())
        for tree in tqdm(trees, desc=f"profile {folder.name}", unit="tree"):
            profiles.append(profile_medusa(target, folder, tree, prompts, args.max_new_tokens, device,
                                           config.target.dtype))
    if not args.no_ngram:
        profiles.append(profile_lookup(target, prompts, args.k_max, args.max_new_tokens, device,
                                       config.target.dtype))
    print(format_profiles(profiles))
    for p in profiles:
        print(p.reasoning())
    print(recommendation(profiles))
    if args.json:
        print(json.dumps([asdict(p) for p in profiles], indent=2))
    return 0
