"""The rules every request meets, in one place: ``validate_request`` for its values and ``check_prompt`` for its
prompt against the engines' limits. The Python API, `run`'s flags and the Triton inputs all pass through them;
callers with other spellings (``--max-new-tokens``, ``max_tokens``) pass ``names`` so an error names what the user
typed."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import short_repr
from ..speculative import SamplingParams
from .results import RequestError

MAX_NEW_TOKENS = 2**31 - 1  # what an INT32 tensor (Triton's max_tokens) can carry
DraftLen = int | str | None  # an int K >= 0, "auto" (dynamic K) or None (the executor's K)


@dataclass(frozen=True)
class DraftPlan:
    """How many tokens a request drafts per step."""

    k_max: int  # upper bound (and the fixed K when not dynamic)
    dynamic: bool = False  # follow the observed acceptance (next_draft_len) within 1..k_max
    explicit: bool = False  # the caller named K: the engine drafts exactly that, never a lower batch-wide cap


@dataclass(frozen=True)
class RequestValues:
    max_new_tokens: int
    sampling: SamplingParams
    seed: int | None
    draft: DraftPlan


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_request(max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, seed=None,
                     max_draft_len: DraftLen = None, *, default_k: int = 0, draft_len_limit: int | None = None,
                     names: Mapping[str, str] | None = None) -> RequestValues:
    """Check a request's values; raises RequestError naming the value (as the caller spells it) and the fix.

    ``max_draft_len``: K for this request (an int >= 0, "auto" for dynamic K up to ``default_k``, None for
    ``default_k``), at most ``draft_len_limit`` (the K the target engine was built for)."""
    def name(key: str) -> str:
        return (names or {}).get(key, key)

    if not _int(max_new_tokens) or not 0 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise RequestError(f"{name('max_new_tokens')}: {short_repr(max_new_tokens)} must be an integer >= 0 and at "
                           f"most {MAX_NEW_TOKENS} (the number of tokens to generate)")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise RequestError(f"{name('temperature')}: {short_repr(temperature)} must be a finite number >= 0 "
                           f"(0 = greedy)")
    if not _int(top_k) or top_k < 0:
        raise RequestError(f"{name('top_k')}: {short_repr(top_k)} must be an integer >= 0 (0 disables it)")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise RequestError(f"{name('top_p')}: {short_repr(top_p)} must be in (0, 1] (1 disables it)")
    if seed is not None and (not _int(seed) or not 0 <= seed < 2**64):
        raise RequestError(f"{name('seed')}: {short_repr(seed)} must be an integer in [0, 2**64)")
    plan = _draft_plan(max_draft_len, default_k, name("max_draft_len"))
    if draft_len_limit is not None and plan.explicit and plan.k_max > draft_len_limit:
        raise RequestError(f"{name('max_draft_len')}: {plan.k_max} is larger than the {draft_len_limit} the target "
                           f"engine was built for; lower it or rebuild with speculative.max_draft_len: {plan.k_max}")
    return RequestValues(max_new_tokens, SamplingParams(float(temperature), top_k, float(top_p)), seed, plan)


def _draft_plan(max_draft_len: DraftLen, default: int, name: str) -> DraftPlan:
    if max_draft_len is None:
        return DraftPlan(default)
    if max_draft_len == "auto":
        return DraftPlan(default, dynamic=default > 0)
    if not _int(max_draft_len) or max_draft_len < 0:
        raise RequestError(f"{name}: {short_repr(max_draft_len)} must be an integer >= 0 (0 = target-only "
                           f"decoding), None or 'auto'")
    return DraftPlan(max_draft_len, explicit=True)


def check_prompt(prompt_ids: list[int], max_new_tokens: int, *, max_input_len: int | None,
                 max_seq_len: int | None, vocab_size: int | None = None) -> None:
    """Raise RequestError naming the value and the fix when a prompt does not fit these engines."""
    if not prompt_ids:
        raise RequestError("prompt: empty; give at least one token")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt_ids):
        raise RequestError(f"prompt: token ids must be in [0, {vocab_size})")
    if max_input_len is not None and len(prompt_ids) > max_input_len:
        raise RequestError(f"prompt: {len(prompt_ids)} tokens exceeds max_input_len {max_input_len}; "
                           f"shorten it or rebuild with a larger build.max_input_len")
    if max_seq_len is not None and len(prompt_ids) + max_new_tokens > max_seq_len:
        raise RequestError(f"max_new_tokens: {len(prompt_ids)} prompt + {max_new_tokens} new tokens exceeds "
                           f"max_seq_len {max_seq_len}; ask for at most "
                           f"{max(max_seq_len - len(prompt_ids), 0)} new tokens")
