"""One benchmark run: every method on the same prompts, repeats interleaved, records and machine description.

Methods (all greedy, batch 1):
  target       our runtime with max_draft_len=0: the baseline every speedup is measured against
  speculative  our runtime at each K of the sweep (BenchOptions.swept: --k-values within 1..k_max)
  dynamic      our runtime with max_draft_len="auto" (the executor picks K per step)
  ngram        our runtime, n-gram (prompt-lookup) proposals at the executor's K: no draft model at all
  ngram+draft  our runtime, per step the better of lookup and the draft model for the request (the executor's K)
  suffix       our runtime, suffix decoding at the executor's K (where its trees are installed): the past outputs
               are forgotten whenever a prompt comes round again, so a run drafts from the other prompts' outputs of
               its round, never from its own earlier runs (a repeat of the same prompt would find its answer there)
  medusa       our runtime, Medusa heads' candidate tree verified in one pass (engines built with method medusa;
               K = the tree's depth); acceptance_by_position is then per tree depth
  eagle3       our runtime, EAGLE-3 heads' chain at each K of the sweep (engines built with an eagle3 section)
  adaptive     our runtime as `serve` runs it: the engine's adaptive-K policy chooses each row's K per step from
               measured costs and each request's recent acceptance (torch runtime), with the executor's method
  hf_target    Hugging Face generate() on the same target model (a reference for our runtime's overhead)
  hf_assisted  Hugging Face generate(assistant_model=draft) with a constant num_assistant_tokens = K sweep
  hf_lookup    Hugging Face generate(prompt_lookup_num_tokens=K) at the executor's K: the peer of ngram
(Without a draft model, speculative.method: ngram, only target, ngram at the sweep's K up to the executor's K,
adaptive, hf_target and hf_lookup run. The Hugging Face methods need the torch models: not on TensorRT-LLM engines.)

A run: a short warm-up of every method, the cost terms (timing.py), one calibration generation per method (so the
caller can say how long the run will take before it starts), then the timed repeats. Repeats are interleaved
(repeat 1 of every method, then repeat 2, ...) so that load from other processes on a shared machine spreads over
all methods instead of penalising whichever ran during the burst.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ..methods import Method, suffix_tree_problem
from .measure import Sample, hf_sample, stream_sample
from .records import finish_records, make_record
from .timing import CostTerms, measure_call_costs, measure_costs


@dataclass
class BenchOptions:
    prompt_sets: list[str]
    max_new_tokens: int = 32
    num_prompts: int = 4
    k_max: int = 8
    repeats: int = 3
    skip_hf: bool = False
    cost_repeats: int = 20
    k_values: list[int] | None = None  # the K of the sweeps (None: every K = 1..k_max); cost terms cover 1..k_max

    def swept(self, limit: int | None = None) -> list[int]:
        """The sweep's K values, within k_max and ``limit``."""
        top = self.k_max if limit is None else min(self.k_max, limit)
        return [k for k in (self.k_values or range(1, self.k_max + 1)) if 1 <= k <= top]


@dataclass
class BenchMethod:
    name: str
    k: int | str
    run: Callable[[list[int], int], Sample]  # (prompt ids, max new tokens) -> one timed generation

    @property
    def key(self) -> tuple[str, int | str]:
        return self.name, self.k


WARMUP_TOKENS = 8  # enough steps to reach every code path of a method; the one-off costs are per call, not per token


def build_methods(executor, options: BenchOptions) -> list[BenchMethod]:
    """Every method the run measures, cheap to build (nothing runs until a method is called)."""
    with_draft = executor.has_draft_model
    ours = partial(_ours, executor)
    methods = [BenchMethod("target", 0, ours(0))]
    if with_draft:
        methods += [BenchMethod("speculative", k, ours(k)) for k in options.swept()]
        methods.append(BenchMethod("dynamic", "auto", ours("auto")))
    lookup_k = min(executor.max_draft_len, options.k_max)
    for proposer in (Method.NGRAM, Method.NGRAM_DRAFT) if with_draft else (Method.NGRAM,):
        # Without a draft model the lookup is the method under test: sweep its K as the draft's K is swept.
        for k in ([lookup_k] if with_draft else options.swept(lookup_k)):
            methods.append(BenchMethod(proposer.value, k, ours(k, proposer)))
    if (trees := _suffix_trees(executor)) is not None:
        methods.append(BenchMethod(Method.SUFFIX.value, lookup_k, suffix_runner(executor, trees, lookup_k)))
    if getattr(executor, "has_medusa_heads", False):  # heads on the target: its tree's depth is K
        depth = executor.engine.proposers[Method.MEDUSA].tree.max_depth if hasattr(executor, "engine") \
            else executor.max_draft_len
        methods.append(BenchMethod(Method.MEDUSA.value, depth, ours(depth, Method.MEDUSA)))
    if getattr(executor, "has_eagle3_heads", False):
        methods += [BenchMethod(Method.EAGLE3.value, k, ours(k, Method.EAGLE3)) for k in options.swept()]
    if hasattr(executor, "engine"):
        methods.append(BenchMethod("adaptive", "policy", adaptive_runner(executor)))
    if not options.skip_hf:
        methods += hf_methods(executor, options.swept(), lookup_k)
    return methods


def _ours(executor, k: int | str | None, method: Method | None = None) -> Callable[[list[int], int], Sample]:
    """A generation on our runtime at K = ``k`` (0: target only, "auto": dynamic) with ``method``'s proposer."""
    return lambda ids, max_new_tokens: stream_sample(executor, ids, max_new_tokens, k, method=method)


def _suffix_trees(executor):
    """The executor's suffix trees (the torch engine's proposer's, or the TensorRT-LLM executor's own), or None
    where they are not installed."""
    if suffix_tree_problem() is not None:
        return None
    if hasattr(executor, "engine"):
        return executor.engine.proposers[Method.SUFFIX].trees
    return executor.suffix


def suffix_runner(executor, trees, k: int) -> Callable[[list[int], int], Sample]:
    """Suffix decoding whose past outputs are those of the current round: a round ends when a prompt comes again
    (the warm-up, the calibration and each interleaved repeat), so a run drafts from what the other prompts answered
    (what a workload of distinct requests offers), never from its own earlier answer. Prompt prefixes stay cached as
    for every other method."""
    runs: dict[tuple[int, ...], int] = {}
    rounds = [0]

    def run(ids: list[int], max_new_tokens: int) -> Sample:
        key = tuple(ids)
        runs[key] = runs.get(key, 0) + 1
        if runs[key] > rounds[0]:
            rounds[0] = runs[key]
            trees.forget_past_outputs()
        return stream_sample(executor, ids, max_new_tokens, k, method=Method.SUFFIX)
    return run


def hf_methods(executor, k_values: list[int], lookup_k: int) -> list[BenchMethod]:
    """Hugging Face generate() on the same models: plain, assisted by the draft at each K, and prompt lookup."""
    target = executor.target.model
    draft = executor.draft.model if executor.has_draft_model else None
    pad = getattr(executor.tokenizer, "pad_token_id", None)
    methods = [BenchMethod("hf_target", 0, lambda ids, n: hf_sample(target, None, ids, n, 0, pad))]
    if draft is not None:
        methods += [BenchMethod("hf_assisted", k, lambda ids, n, k=k: hf_sample(target, draft, ids, n, k, pad))
                    for k in k_values]
    methods.append(BenchMethod("hf_lookup", lookup_k, lambda ids, n: hf_sample(
        target, None, ids, n, lookup_k, pad, prompt_lookup=True)))
    return methods


def adaptive_runner(executor) -> Callable[[list[int], int], Sample]:
    """Runs a prompt with the engine's adaptive-K policy on, as `serve` does (K not named, so the policy's cap
    applies); the policy is calibrated on the first call and keeps what it measures across the benchmark's runs."""
    from ..executor.draft_policy import DraftPolicy

    engine = executor.engine
    policy = DraftPolicy(executor.max_draft_len)
    calibrated = []

    def run(ids: list[int], max_new_tokens: int) -> Sample:
        if not calibrated:
            engine.calibrate(policy, 1)
            calibrated.append(True)
        before, engine.policy = engine.policy, policy
        try:
            return stream_sample(executor, ids, max_new_tokens, None)
        finally:
            engine.policy = before
    return run


def fit_prompt(executor, prompt: str, max_new_tokens: int) -> list[int]:
    """Token ids of ``prompt``, keeping its end when prompt + new tokens would exceed the executor's limits."""
    ids = executor.encode(prompt)
    limits = [executor.max_input_len, (executor.max_seq_len - max_new_tokens) if executor.max_seq_len else None]
    limit = min(x for x in limits if x is not None) if any(x is not None for x in limits) else len(ids)
    if limit < 1:
        raise ValueError(f"--max-new-tokens: {max_new_tokens} leaves no room for a prompt within max_seq_len "
                         f"{executor.max_seq_len}; lower it")
    return ids[-limit:]


def _fit_options(executor, options: BenchOptions, note: Callable[[str], None], notes: dict) -> None:
    """Clip the sweep to the engine's K and leave out what these engines cannot run, saying so."""
    limit = getattr(executor, "engine_draft_len", None)
    if limit is not None and options.k_max > limit:
        options.k_max = limit
        if not options.swept():  # every K asked for is past the engine's: measure its largest instead
            options.k_values = [limit]
        note(f"note: the target engine was built for K <= {limit}; sweeping K = "
             f"{','.join(map(str, options.swept())) if options.k_values else f'1..{limit}'} "
             f"(build with a larger speculative.max_draft_len to go further)")
    if not hasattr(executor, "engine") and not options.skip_hf:  # TensorRT-LLM engines are not torch models
        note("note: Hugging Face baselines skipped: they need the torch models, and these are TensorRT-LLM engines")
        notes["hf_skipped"] = "engines are not torch models"
        options.skip_hf = True


def calibrate(methods: list[BenchMethod], ids: list[int], max_new_tokens: int) -> dict[tuple, float]:
    """Seconds of one generation of ``ids`` per method, after the warm-up: what each timed generation will cost."""
    seconds = {}
    for method in methods:
        start = time.perf_counter()
        method.run(ids, max_new_tokens)
        seconds[method.key] = time.perf_counter() - start
    return seconds


def timed_runs(methods: list[BenchMethod], fitted: dict[str, list[list[int]]], options: BenchOptions
               ) -> dict[tuple[str, str, int | str], list[list[Sample]]]:
    """(set, method, K) -> samples[repeat][prompt]. Repeats are interleaved: repeat 1 of every method, then 2, ..."""
    from tqdm import tqdm

    samples: dict[tuple[str, str, int | str], list[list[Sample]]] = {}
    total = options.repeats * len(methods) * sum(len(v) for v in fitted.values())
    bar = tqdm(total=total, desc="bench", unit="gen")
    for _ in range(options.repeats):
        for set_name, prompts in fitted.items():
            for method in methods:
                bar.set_postfix_str(f"{set_name} {method.name} K={method.k}", refresh=False)
                rep = []
                for ids in prompts:
                    rep.append(method.run(ids, options.max_new_tokens))
                    bar.update(1)
                samples.setdefault((set_name, method.name, method.k), []).append(rep)
    bar.close()
    return samples


def run_bench(executor, prompt_sets: dict[str, list[str]], options: BenchOptions,
              note: Callable[[str], None] = print,
              announce: Callable[[list[BenchMethod], dict[tuple, float]], None] | None = None
              ) -> tuple[list[dict], CostTerms, dict]:
    """Measure every method on every prompt set; returns (records, cost terms, notes for results.json).

    ``announce(methods, seconds)``, when given, is called before the timed runs start with each method's seconds
    for one generation of the first prompt (calibrate), so the caller can say how long the run will take."""
    notes: dict = {}
    fitted = {name: [fit_prompt(executor, p, options.max_new_tokens) for p in prompts]
              for name, prompts in prompt_sets.items()}
    first = next(iter(fitted.values()))[0]
    _fit_options(executor, options, note, notes)
    methods = build_methods(executor, options)
    # Warm-up: first calls pay one-off allocation and dispatch costs nobody should be billed for.
    for method in methods:
        method.run(first[:16], min(WARMUP_TOKENS, options.max_new_tokens))
    measure = measure_costs if hasattr(executor, "engine") else measure_call_costs
    costs = measure(executor.target, executor.draft, first, options.k_max, repeats=options.cost_repeats)
    # (without a draft model the draft cost is 0: lookups run no model)
    if announce is not None:
        announce(methods, calibrate(methods, first, options.max_new_tokens))
    samples = timed_runs(methods, fitted, options)
    # EAGLE-3 heads run no draft model: their c is the engine's own measurement over the run (one draft position
    # over one verify), known only without a draft model whose positions it would pool.
    own_c = {Method.EAGLE3.value: executor.engine.costs.value} \
        if getattr(executor, "has_eagle3_heads", False) and not executor.has_draft_model else {}
    records = [make_record(method, k, set_name, reps, costs, own_c.get(method))
               for (set_name, method, k), reps in samples.items()]
    return finish_records(records), costs, notes


def machine_info(device: str) -> dict:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {"device": device, "cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def git_commit(repo: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
