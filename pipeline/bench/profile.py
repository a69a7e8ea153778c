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
  suffix       suffix decoding (c = 0), counted per target step like ngram; where its trees are installed. The
               prompts run as one batch, so later ones draft from earlier ones' outputs, as served requests do
  ngram+DRAFT  the per-step choice between lookup and that draft, run at K = k_max: its tokens per step over its
               cost per step (the verify, plus K c on the steps where the draft ran).
  medusa:TREE  Medusa heads (--medusa, one run per tree in --tree): a tree step's cost is not a chain's K c + v_K,
               so it is timed: target-only and Medusa decode the same prompts at batch 1, interleaved over
               MEDUSA_ROUNDS rounds, each prompt keeping its best; the speedup is the measured ratio (on this machine).
  eagle3:HEADS EAGLE-3 heads (--eagle3, default the config's): acceptance per position from one run at k_max,
               priced like a draft model with the engine's own measured c (eagle3_profile.py).
The recommendation names the method (speculative.method) as well as the draft and K (or the tree). When the prompts
file carries more than one set label, each set gets its own recommendation too, from the same generations grouped
by label (profile_results.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from ..config import MAX_DRAFT_LEN_LIMIT
from ..errors import PipelineError
from ..methods import Method, suffix_tree_problem
from ..speculative.tree_choices import NAMED_TREES
from .arg_checks import check_range
from .eagle3_profile import profile_eagle3
from .medusa_profile import tune_tree
from .profile_results import (MEDUSA_ROUNDS, DraftProfile, SetFigures, by_label, chain_figures, format_per_set,
                              format_profiles, merged, per_set_recommendations, recommendation, timing_context)


def profile_draft(target_path: Path, draft_name: str, draft_path: Path | None, prompts: list[str | list[int]],
                  labels: list[str], k_max: int, max_new_tokens: int, device: str, dtype: str, cost_repeats: int = 15,
                  draft_dtype: str | None = None) -> DraftProfile:
    """Measure one candidate (in ``draft_dtype``, default the target's ``dtype``) on all prompts and per set label
    (``labels``, one per prompt); a draft whose tokenizer differs comes back 'incompatible' instead of raising."""
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
    stats = merged([r.stats for r in results])
    if len(stats.acceptance_by_position) < k_max:
        return DraftProfile(draft_name, "unavailable", f"only {len(stats.acceptance_by_position)} draft positions "
                                                       f"measured; raise --max-new-tokens above --k-max {k_max}")
    costs = measure_costs(executor.target, executor.draft, timing_context(ids, results, k_max), k_max,
                          repeats=cost_repeats)
    c, verify = costs.cost_ratio_c, costs.verify_cost_ratio
    every = chain_figures([r.stats for r in results], k_max, c, verify)
    per_set = {name: chain_figures([r.stats for r in group], k_max, c, verify)
               for name, group in by_label(labels, results).items()}
    return DraftProfile(draft_name, "ok", "", every.acceptance_rate, every.acceptance_by_position, c, verify,
                        every.expected_speedup, every.best_k, every.best_speedup, dtype=draft_dtype or dtype,
                        per_set=per_set)


def profile_lookup(target_path: Path, prompts: list[str | list[int]], labels: list[str], k_max: int,
                   max_new_tokens: int, device: str, dtype: str, cost_repeats: int = 15,
                   method: Method = Method.NGRAM) -> DraftProfile:
    """A proposer without a model (n-gram lookups, or suffix trees): acceptance per position per target step,
    c = 0."""
    from ..executor import SpeculativeExecutor
    from .runner import fit_prompt
    from .timing import measure_costs

    executor = SpeculativeExecutor.from_pretrained(target_path, None, max_draft_len=k_max, device=device,
                                                   dtype=dtype, method=method)
    ids = [fit_prompt(executor, p, max_new_tokens) for p in prompts]
    results = executor.generate(ids, max_new_tokens, temperature=0.0, max_draft_len=k_max)
    costs = measure_costs(executor.target, None, timing_context(ids, results, k_max), k_max, repeats=cost_repeats)
    verify = costs.verify_cost_ratio
    # Per target step, not per proposal: a step where nothing matched emits one token at full cost.
    every = chain_figures([r.stats for r in results], k_max, 0.0, verify, per_step=True)
    per_set = {name: chain_figures([r.stats for r in group], k_max, 0.0, verify, per_step=True)
               for name, group in by_label(labels, results).items()}
    return DraftProfile(method.value, "ok", "", every.acceptance_rate, every.acceptance_by_position, 0.0, verify,
                        every.expected_speedup, every.best_k, every.best_speedup, method=method, per_set=per_set)


def profile_medusa(target_path: Path, heads: Path, choices, prompts: list, labels: list[str], max_new_tokens: int,
                   device: str, dtype: str) -> DraftProfile:
    """Medusa heads with one tree: greedy acceptance per depth, and the speedup timed against target-only (over
    all prompts, and per set label)."""
    from ..executor import SpeculativeExecutor
    from .runner import fit_prompt

    label = f"medusa:{choices if isinstance(choices, str) else f'{len(choices)} nodes'}"
    try:
        executor = SpeculativeExecutor.from_pretrained(target_path, None, device=device, dtype=dtype,
                                                       method=Method.MEDUSA, medusa=heads, medusa_choices=choices)
    except (PipelineError, ValueError, OSError) as exc:
        return DraftProfile(label, "unavailable", str(exc), method=Method.MEDUSA, choices=choices)
    ids = [fit_prompt(executor, p, max_new_tokens) for p in prompts]
    best = {0: [float("inf")] * len(ids), None: [float("inf")] * len(ids)}  # K 0: target-only; None: the tree
    results = []
    for _ in range(MEDUSA_ROUNDS):
        for k, seconds in best.items():
            run = []
            for i, x in enumerate(ids):
                start = time.perf_counter()
                run.append(executor.generate([x], max_new_tokens, temperature=0.0, max_draft_len=k)[0])
                seconds[i] = min(seconds[i], time.perf_counter() - start)
            if k is None:
                results = run
    stats = merged([r.stats for r in results])
    per_set = {}
    for name, rows in by_label(labels, list(zip(results, best[0], best[None]))).items():
        group = merged([r.stats for r, _, _ in rows])
        per_set[name] = SetFigures(len(rows), group.acceptance_rate, group.acceptance_by_position, [],
                                   executor.max_draft_len, sum(t for _, t, _ in rows) / sum(m for _, _, m in rows),
                                   group.mean_accepted_len)
    return DraftProfile(label, "ok", "", stats.acceptance_rate, stats.acceptance_by_position, 0.0, [], [],
                        executor.max_draft_len, sum(best[0]) / sum(best[None]), method=Method.MEDUSA,
                        dtype=str(executor.target.dtype).removeprefix("torch."),
                        tokens_per_step=stats.mean_accepted_len, choices=choices, per_set=per_set)


def profile_hybrid(target_path: Path, draft: DraftProfile, draft_path: Path, prompts: list[str | list[int]],
                   labels: list[str], k_max: int, max_new_tokens: int, device: str, dtype: str,
                   draft_dtype: str | None = None) -> DraftProfile:
    """ngram+draft at K = k_max, costed with the draft's measured c and verify cost."""
    from ..executor import SpeculativeExecutor
    from .runner import fit_prompt

    executor = SpeculativeExecutor.from_pretrained(target_path, draft_path, max_draft_len=k_max, device=device,
                                                   dtype=dtype, method=Method.NGRAM_DRAFT, draft_dtype=draft_dtype)
    ids = [fit_prompt(executor, p, max_new_tokens) for p in prompts]
    results = executor.generate(ids, max_new_tokens, temperature=0.0, max_draft_len=k_max)
    every, share = _hybrid_figures([r.stats for r in results], draft, k_max)
    per_set = {name: _hybrid_figures([r.stats for r in group], draft, k_max)[0]
               for name, group in by_label(labels, results).items()}
    return DraftProfile(f"ngram+{draft.draft}", "ok", "", every.acceptance_rate, [], draft.cost_ratio_c,
                        draft.verify_cost_ratio, [], k_max, every.best_speedup, method=Method.NGRAM_DRAFT,
                        draft_step_share=share, dtype=draft.dtype, per_set=per_set)


def _hybrid_figures(stats: list, draft: DraftProfile, k_max: int) -> tuple[SetFigures, float]:
    """Tokens per step over cost per step (the verify, plus K c on the steps where the draft ran), and the share of
    speculative steps the draft proposed."""
    total = merged(stats)
    draft_steps = total.by_proposer.get(Method.DRAFT_MODEL, [0, 0, 0])[2]
    lookup_steps = total.by_proposer.get(Method.NGRAM, [0, 0, 0])[2]
    cost_per_step = (draft.verify_cost_ratio[k_max - 1]
                     + (draft_steps / total.target_steps) * k_max * draft.cost_ratio_c)
    speedup = (total.generated_tokens / total.target_steps) / cost_per_step
    return (SetFigures(len(stats), total.acceptance_rate, [], [], k_max, speedup, total.mean_accepted_len),
            draft_steps / max(draft_steps + lookup_steps, 1))


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
    check_range("--k-max", args.k_max, 1, MAX_DRAFT_LEN_LIMIT)
    if args.max_new_tokens <= args.k_max:
        raise PipelineError(f"--max-new-tokens: {args.max_new_tokens} must exceed --k-max {args.k_max} so every "
                            f"draft position is measured; raise it")
    config, device, target, prompts, labels = _load(args)
    profiles = _profile_drafts(args, config, device, target, prompts, labels)
    profiles += _profile_medusa_heads(args, config, device, target, prompts, labels)
    eagle3 = [Path(h) for h in args.eagle3] or ([config.eagle3_dir()] if config.has_eagle3_heads else [])
    profiles += [profile_eagle3(target, heads, prompts, labels, args.k_max, args.max_new_tokens, device,
                                config.target.dtype) for heads in eagle3]
    if not args.no_ngram:
        profiles.append(profile_lookup(target, prompts, labels, args.k_max, args.max_new_tokens, device,
                                       config.target.dtype))
        if suffix_tree_problem() is None:
            profiles.append(profile_lookup(target, prompts, labels, args.k_max, args.max_new_tokens, device,
                                           config.target.dtype, method=Method.SUFFIX))
    print(format_profiles(profiles))
    for p in profiles:
        print(p.reasoning())
    per_set = format_per_set(profiles)
    if per_set:
        print(per_set)
    print(recommendation(profiles, " over all prompts" if per_set else ""))
    for line in per_set_recommendations(profiles):
        print(line)
    if args.json:
        print(json.dumps([asdict(p) for p in profiles], indent=2))
    return 0


def _load(args):
    """(config with resolved defaults, device, target folder, prompts, their set labels): the prompts file is read
    before any model loads."""
    from ..checks import with_resolved_defaults
    from ..config import load_config
    from ..models import load_tokenizer, resolve_model
    from ..prompt_files import encode_items, read_prompt_file

    items = read_prompt_file(args.prompts, flag="--prompts")
    config = with_resolved_defaults(load_config(args.config))  # dtype: auto -> what a build would choose
    device = config.runtime.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved_target = resolve_model(config.target, "target", config.base_dir)
    # Chats become token ids through the target's chat template; raw text stays text (the executor encodes it).
    tokenizer = load_tokenizer(resolved_target) if any(item.is_chat for item in items) else None
    prompts = encode_items(items, tokenizer, source=config.target.model)
    return config, device, resolved_target.path, prompts, [item.set for item in items]


def _profile_drafts(args, config, device: str, target: Path, prompts: list, labels: list[str]) -> list[DraftProfile]:
    """Each candidate draft model, and ngram+that draft beside it."""
    from tqdm import tqdm

    profiles = []
    names = args.draft or ([config.draft.model] if config.draft is not None and not args.medusa and not args.eagle3
                           else [])
    for name in tqdm(names, desc="profile", unit="draft"):
        path = _resolve_draft(name, config)
        draft_dtype = _draft_dtype(name, path, config, device)
        profiles.append(profile_draft(target, name, path, prompts, labels, args.k_max, args.max_new_tokens, device,
                                      config.target.dtype, draft_dtype=draft_dtype))
        if not args.no_ngram and profiles[-1].status == "ok":
            profiles.append(profile_hybrid(target, profiles[-1], path, prompts, labels, args.k_max,
                                           args.max_new_tokens, device, config.target.dtype, draft_dtype=draft_dtype))
    return profiles


def _profile_medusa_heads(args, config, device: str, target: Path, prompts: list, labels: list[str]
                          ) -> list[DraftProfile]:
    """Each Medusa heads folder with each tree (and, without --tree, one tuned to these heads and prompts)."""
    from tqdm import tqdm

    medusa_spec = config.speculative.medusa if config.has_medusa_heads else None
    heads = [Path(h) for h in args.medusa] or ([config.medusa_dir()] if medusa_spec is not None else [])
    trees = [_tree_arg(t) for t in args.tree] or ([medusa_spec.choices] if medusa_spec is not None
                                                  else list(NAMED_TREES))
    profiles = []
    for folder in heads:
        if not args.tree:  # a tree tuned to these heads, prompts and machine, beside the configured or named ones
            tuned = tune_tree(target, folder, prompts, args.max_new_tokens, device, config.target.dtype)
            trees = trees + ([tuned.paths] if tuned.paths else [])
            print(tuned.describe())
        for tree in tqdm(trees, desc=f"profile {folder.name}", unit="tree"):
            profiles.append(profile_medusa(target, folder, tree, prompts, labels, args.max_new_tokens, device,
                                           config.target.dtype))
    return profiles
