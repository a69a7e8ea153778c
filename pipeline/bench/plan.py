"""What one `bench` run will measure, decided from the flags before any model loads: the prompt sets, the K sweep
and the sizes, and the fuller run the quick defaults stand in for.

The defaults are sized to finish in a few minutes on a 2-core CPU with a 135M model (about 100 timed generations
of 32 tokens): DEFAULT_TOTAL_PROMPTS prompts shared among the sets (at least one each), 32 new tokens, K = 1, 2, 4,
8, three repeats (the fewest whose median a single burst cannot move). A full run (FULL_*) is every prompt of each
set, 64 new tokens and every K: the same measurement with less noise between prompts, and about ten times the
time; bench says how long both take before the timed part starts (estimate.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import MAX_DRAFT_LEN_LIMIT
from ..errors import PipelineError
from .arg_checks import check_range

DEFAULT_MAX_NEW_TOKENS = 32
DEFAULT_REPEATS = 3
DEFAULT_TOTAL_PROMPTS = 4
FULL_MAX_NEW_TOKENS = 64
FULL_BUILTIN_PROMPTS = 8  # per built-in set; a prompts file's full run takes every prompt
FULL_REPEATS = 3


def k_values_arg(text: str) -> list[int] | str:
    """--k-values: "all" (every K = 1..--k-max) or a comma list such as "1,2,4,8"."""
    if text.strip() == "all":
        return "all"
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise PipelineError(f"--k-values: {text!r} is not a comma list of integers; write e.g. 1,2,4,8 or all") \
            from None
    if not values:
        raise PipelineError("--k-values: empty; write e.g. 1,2,4,8 or all")
    return values


def default_k_values(k_max: int) -> list[int]:
    """Powers of two below ``k_max``, then ``k_max``: 8 -> 1, 2, 4, 8; 6 -> 1, 2, 4, 6; 3 -> 1, 2, 3."""
    values, k = [], 1
    while k < k_max:
        values.append(k)
        k *= 2
    return values + [k_max]


def default_num_prompts(num_sets: int) -> int:
    """Prompts per set when --num-prompts is not given: DEFAULT_TOTAL_PROMPTS shared among the sets, at least 1."""
    return max(1, DEFAULT_TOTAL_PROMPTS // max(num_sets, 1))


@dataclass
class BenchPlan:
    prompt_sets: dict[str, list]  # set -> prompts: texts (built-in sets) or PromptItems (a --prompts file)
    max_new_tokens: int
    k_max: int
    k_values: list[int]  # the sweep, within 1..k_max
    repeats: int
    skip_hf: bool
    prompts_file: Path | None
    full_sizes: dict[str, int]  # set -> its prompts in a full run

    @property
    def num_prompts(self) -> int:
        return max(len(prompts) for prompts in self.prompt_sets.values())

    def full_flags(self) -> str:
        """The flags of a full run of the same sets."""
        return (f"--num-prompts {max(self.full_sizes.values())} --max-new-tokens {FULL_MAX_NEW_TOKENS} "
                f"--k-values all --repeats {FULL_REPEATS}")

    def is_full(self) -> bool:
        every_prompt = all(len(self.prompt_sets[name]) >= size for name, size in self.full_sizes.items())
        return (every_prompt and self.max_new_tokens >= FULL_MAX_NEW_TOKENS
                and self.k_values == list(range(1, self.k_max + 1)) and self.repeats >= FULL_REPEATS)

    def describe(self) -> str:
        sizes = ", ".join(f"{name} {len(prompts)}" for name, prompts in self.prompt_sets.items())
        return (f"bench plan: prompts per set {sizes}; {self.max_new_tokens} new tokens; K "
                f"{','.join(map(str, self.k_values))}; {self.repeats} repeats"
                + ("; Hugging Face baselines skipped" if self.skip_hf else ""))


def check_args(args) -> None:
    """The numeric flags, named as spelled, before anything is read or loaded."""
    check_range("--max-new-tokens", args.max_new_tokens, 2, fix="latency needs at least two tokens")
    if args.num_prompts is not None:
        check_range("--num-prompts", args.num_prompts, 1)
    check_range("--k-max", args.k_max, 1, MAX_DRAFT_LEN_LIMIT)
    check_range("--repeats", args.repeats, 1)
    if isinstance(args.k_values, list):
        for k in args.k_values:
            check_range("--k-values", k, 1, args.k_max, fix="raise --k-max or leave the value out")
    if args.prompts is not None and args.prompt_set is not None:
        raise PipelineError("--prompt-set and --prompts: pass one of them (a built-in set, or your own file, whose "
                            "set labels name the sets)")


def plan_from_args(args, config) -> BenchPlan:
    """The run's plan; a bad prompts file or set name fails here, in milliseconds."""
    check_args(args)
    if args.prompts is not None:
        from ..prompt_files import group_by_set, read_prompt_file

        every = group_by_set(read_prompt_file(args.prompts, flag="--prompts"))
        per_set = args.num_prompts or default_num_prompts(len(every))
        sets = {name: items[:per_set] for name, items in every.items()}
        full = {name: len(items) for name, items in every.items()}
    else:
        names = builtin_set_names(args.prompt_set or "code")
        per_set = args.num_prompts or default_num_prompts(len(names))
        sets = builtin_prompt_sets(names, per_set, config)
        full = {name: FULL_BUILTIN_PROMPTS for name in names}
    k_values = (list(range(1, args.k_max + 1)) if args.k_values == "all"
                else args.k_values or default_k_values(args.k_max))
    return BenchPlan(sets, args.max_new_tokens, args.k_max, k_values, args.repeats, args.skip_hf, args.prompts,
                     full)


def builtin_set_names(spec: str) -> list[str]:
    """--prompt-set: "code", a comma list of built-in sets, or "all"."""
    from .prompts import PROMPT_SETS

    return list(PROMPT_SETS) if spec == "all" else [s.strip() for s in spec.split(",")]


def builtin_prompt_sets(names: list[str], num_prompts: int, config) -> dict[str, list[str]]:
    from .prompts import load_prompt_set, pair_seed_of

    target_folder = config.base_dir / config.target.model
    pair_seed = pair_seed_of(target_folder) if target_folder.is_dir() else 0
    try:
        return {name: load_prompt_set(name, num_prompts, pair_seed=pair_seed) for name in names}
    except ValueError as exc:
        raise PipelineError(str(exc)) from None


def encoded_sets(plan: BenchPlan, tokenizer, source: str) -> dict[str, list]:
    """What the executor takes: built-in texts as they are; a file's chats as token ids through the model's chat
    template, its raw text as text."""
    if plan.prompts_file is None:
        return plan.prompt_sets
    from ..prompt_files import encode_items

    return {name: encode_items(items, tokenizer, source=source) for name, items in plan.prompt_sets.items()}
